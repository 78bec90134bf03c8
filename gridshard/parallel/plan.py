"""Plans: readable tables from module-name patterns to the kind of parallel layer.

A :class:`Plan` says, for one model family, which module becomes which gridshard layer
when :func:`gridshard.parallelize` lays the model out on a mesh:

=================  ===================================  ==========================  =====================
kind               plain module                         1D (± sequence parallel)     2D (q×q grid)
=================  ===================================  ==========================  =====================
``column``         ``nn.Linear`` [out, in]              ColumnParallelLinear         Linear2D
``kv_column``      ``nn.Linear`` of K kv heads          ColumnParallelLinear, kv     Linear2D (K % q == 0)
                                                        heads split, or replicated
                                                        in groups of T/K when T > K
``row``            ``nn.Linear``                        RowParallelLinear            Linear2D
``vocab_embedding`` ``nn.Embedding`` [V, h]             VocabParallelEmbedding       VocabParallelEmbedding2D
``vocab_head``     ``nn.Linear`` [V, h] (may be tied)   ColumnParallelLinear [V_p/T]  VocabParallelClassifier2D
                                                                                    / TiedVocabHead2D
``norm``           RMSNorm [h]                          RMSNorm (SP-aware)           RMSNorm2D
``replicate``      anything                             kept as is (1D without SP    not allowed
                                                        only: its input is whole)
``patch_embedding`` ViT ``ViTEmbeddings`` (conv, cls,    kept as is, replicated       ViTEmbeddings2D
                   positions)                           (its docstring says why)
``layer_norm``     ``nn.LayerNorm`` [h] (with bias)     LayerNorm (SP-aware)         LayerNorm2D
``classifier``     ViT ``ClsClassifier`` [K, h] on the  Classifier1D (replicated;    ClsClassifier2D
                   class token's row                    SP: finds the class token)
=================  ===================================  ==========================  =====================

3D (a q×q×q cube, :func:`gridshard.tensor.tp3d.build.build_3d`): ``column`` / ``kv_column`` → Linear3D
on the residual orientation, ``row`` → Linear3D on the swapped one, ``norm`` → RMSNorm3D,
``vocab_embedding`` → VocabParallelEmbedding3D, ``vocab_head`` → VocabParallelClassifier3D /
TiedVocabHead3D; the ViT kinds and ``replicate`` are refused.

``shared_inputs`` names parent modules whose column children read the same input (q|k|v
of attention, gate|up of the MLP): the parent's input is prepared once (one all-reduce
backward, or one sequence all-gather) and the children's blocks are multiplied in one
matmul (one SUMMA product in 2D), exactly the communication of a fused weight, while each
projection keeps its own canonical parameter.

Patterns are :mod:`fnmatch` patterns over the names of ``model.named_modules()``; the
first matching rule wins. Extend a plan with :meth:`Plan.with_rules`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Tuple

KINDS = ("column", "kv_column", "row", "vocab_embedding", "vocab_head", "norm", "replicate", "patch_embedding",
         "layer_norm", "classifier")


@dataclass(frozen=True)
class Plan:
    """How one model family is laid out (module docstring).

    * ``rules``: pattern → kind.
    * ``shared_inputs``: parent pattern → names of its column children fed the same input.
    * ``attention``: patterns of attention modules; attributes named in
      ``kv_group_attr`` are set to the local query-per-kv-head ratio after splitting.
    * ``sequence_scatter``: with sequence parallelism, where the residual stream is cut
      along the sequence: ``"embedding"`` (the embedding reduce-scatters) or the name of a
      module whose first input is split (for models that build masks and positions from
      the embedding's shape, e.g. Hugging Face's: the first decoder layer).
    """

    rules: Mapping[str, str]
    shared_inputs: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    attention: Tuple[str, ...] = ()
    kv_group_attr: Optional[str] = None
    sequence_scatter: str = "embedding"

    def __post_init__(self):
        for pattern, kind in self.rules.items():
            if kind not in KINDS:
                from ..errors import LayoutError

                raise LayoutError(f"plan rule {pattern!r} → {kind!r}: unknown kind. Fix: use one of {KINDS}.")

    def kind_of(self, name: str) -> Optional[str]:
        return next((kind for pattern, kind in self.rules.items() if fnmatch.fnmatchcase(name, pattern)), None)

    def shared_children(self, name: str) -> Tuple[str, ...]:
        return next((tuple(children) for pattern, children in self.shared_inputs.items()
                     if fnmatch.fnmatchcase(name, pattern)), ())

    def is_attention(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.attention)

    def with_rules(self, rules: Mapping[str, str], **changes) -> "Plan":
        """A copy whose ``rules`` are ``rules`` first, then this plan's (so they take precedence)."""
        return replace(self, rules={**rules, **self.rules}, **changes)

    def prefixed(self, prefix: str) -> "Plan":
        """The same plan for a model whose modules sit under ``prefix`` (e.g. ``"model."``)."""
        def p(pattern):
            return pattern if pattern == "lm_head" else prefix + pattern
        return replace(self, rules={p(k): v for k, v in self.rules.items()},
                       shared_inputs={p(k): v for k, v in self.shared_inputs.items()},
                       attention=tuple(p(a) for a in self.attention),
                       sequence_scatter=self.sequence_scatter if self.sequence_scatter == "embedding"
                       else p(self.sequence_scatter))


#: gridshard's own :class:`gridshard.models.Transformer`.
LLAMA_PLAN = Plan(
    rules={
        "embed_tokens": "vocab_embedding",
        "layers.*.self_attn.q_proj": "column",
        "layers.*.self_attn.k_proj": "kv_column",
        "layers.*.self_attn.v_proj": "kv_column",
        "layers.*.self_attn.o_proj": "row",
        "layers.*.mlp.gate_proj": "column",
        "layers.*.mlp.up_proj": "column",
        "layers.*.mlp.down_proj": "row",
        "layers.*.input_layernorm": "norm",
        "layers.*.post_attention_layernorm": "norm",
        "norm": "norm",
        "lm_head": "vocab_head",
    },
    shared_inputs={"layers.*.self_attn": ("q_proj", "k_proj", "v_proj"),
                   "layers.*.mlp": ("gate_proj", "up_proj")},
    attention=("layers.*.self_attn",),
)

#: Hugging Face ``LlamaForCausalLM`` (and Mistral / Qwen2, which share its names): the
#: same table under ``model.``; the sequence is split at the first decoder layer because
#: the model derives its attention mask and positions from the embedding output's shape.
HF_LLAMA_PLAN = replace(LLAMA_PLAN, kv_group_attr="num_key_value_groups",
                        sequence_scatter="layers.0").prefixed("model.")

#: gridshard's :class:`gridshard.models.vit.VisionTransformer` (Hugging Face ``ViTForImageClassification``
#: names). Under sequence parallelism the residual stream is cut at the first encoder layer's input
#: (the embeddings are replicated and see whole images). ``attention.output.dense`` comes before the
#: MLP's ``output.dense`` pattern, which would match it too.
VIT_PLAN = Plan(
    rules={
        "vit.embeddings": "patch_embedding",
        "vit.encoder.layer.*.attention.attention.query": "column",
        "vit.encoder.layer.*.attention.attention.key": "column",
        "vit.encoder.layer.*.attention.attention.value": "column",
        "vit.encoder.layer.*.attention.output.dense": "row",
        "vit.encoder.layer.*.intermediate.dense": "column",
        "vit.encoder.layer.*.output.dense": "row",
        "vit.encoder.layer.*.layernorm_before": "layer_norm",
        "vit.encoder.layer.*.layernorm_after": "layer_norm",
        "vit.layernorm": "layer_norm",
        "classifier": "classifier",
    },
    shared_inputs={"vit.encoder.layer.*.attention.attention": ("query", "key", "value")},
    attention=("vit.encoder.layer.*.attention.attention",),
    sequence_scatter="vit.encoder.layer.0",
)
