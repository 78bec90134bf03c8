"""Which layers each pipeline stage holds, and the module a rank builds for its stages.

With P pipeline ranks and V virtual stages per rank there are S = P·V stages. Stage s
holds a contiguous run of decoder layers; stage 0 also the embedding, stage S−1 also the
final norm and the LM head. The split itself is a job-layout fact
(:class:`gridshard.job_layout.StageSplit`, default counts :func:`stage_layer_counts`),
decided there once for the builder, the runner, validation and the planner;
``parallel.stage_layers`` overrides it with explicit counts.

Stage s lives on pipeline rank s mod P (``interleaved``: stages r, r+P, r+2P, … on rank r),
so V = 1 is the usual one stage per rank.

Parameter names never change: a rank builds one rank model holding the embedding (if it
has stage 0), its layers under their global index (``layers.7.…``; a Hugging Face model's
``model.layers.7.…``), and the final norm and head (if it has stage S−1) — the single-device
model's names and shapes, so :func:`gridshard.parallelize` gives every parameter the value it
has in the single-device model (initialisation is a function of the name) and checkpoints,
export and resume do not depend on P. With tied embeddings the last stage also holds the
embedding weight (the head's weight); its gradient is summed with the first stage's (:mod:`.tied`).

A stage runs the model family's own forward pieces — ``embed``, ``layer_inputs``,
``run_layer``, ``head`` — which are also what the single-device forward is composed of
(:meth:`gridshard.models.Transformer.forward`; Hugging Face Llama:
:class:`gridshard.models.hf_stages.LlamaStagePieces`; the ViT:
:meth:`gridshard.models.vit.VisionTransformer.forward`, its layers ``vit.encoder.layer.N``, stage 0
fed images and the last stage giving class logits), so there is one description of the
forward (:class:`gridshard.pipeline.stage_module.StageModule`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from ..models.hf_stages import LlamaStagePieces, check_stageable
from ..models.llama import Transformer
from ..models.vit import VisionTransformer
from ..nn.sharding import mesh_coords


def _put(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``name`` in ``root``, creating plain containers on the way."""
    *path, last = name.split(".")
    for part in path:
        if not hasattr(root, part):
            setattr(root, part, nn.Module())
        root = getattr(root, part)
    setattr(root, last, module)


class _RankPart(nn.Module):
    """The modules of the plain model that one pipeline rank holds, under their single-device
    names, taken from the plain model (not copied). A family names its modules: ``EMBEDDING``
    (the token embedding), ``LAYERS`` (the decoder layers' list), ``EVERY_STAGE`` (modules every
    stage calls, e.g. a rotary embedding), ``HEAD`` (final norm and LM head), ``OUTPUT`` (the output
    layer, whose weight a tied embedding shares), and says what a first stage reads and a last
    stage gives (:meth:`stage_input_meta`, :meth:`stage_output_meta`)."""

    EMBEDDING: str
    LAYERS: str
    EVERY_STAGE: tuple = ()
    HEAD: tuple
    OUTPUT: str = "lm_head"                  # the output layer (its weight may be the embedding's)

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        super().__init__()
        self.has_first, self.has_last = has_first, has_last
        embedding = plain.get_submodule(self.EMBEDDING)
        tied = plain.get_submodule(self.OUTPUT).weight is getattr(embedding, "weight", None)
        if has_first or (has_last and tied):
            _put(self, self.EMBEDDING, embedding)
        layers = plain.get_submodule(self.LAYERS)
        _put(self, self.LAYERS, nn.ModuleDict({str(i): layers[i] for i in layer_ids}))
        for name in self.EVERY_STAGE + (self.HEAD if has_last else ()):
            _put(self, name, plain.get_submodule(name))
        if has_last and tied:
            self.lm_head.weight = embedding.weight

    @property
    def embedding_weight_name(self) -> str:
        return self.EMBEDDING + ".weight"

    def decoder_layer(self, i: int) -> nn.Module:
        return self.get_submodule(self.LAYERS)[str(i)]

    def stage_modules(self, layer_ids: Sequence[int], first: bool, last: bool) -> list:
        """The modules stage (``layer_ids``, ``first``, ``last``) calls: its parameters, no other stage's."""
        names = ((self.EMBEDDING,) if first else ()) + self.EVERY_STAGE + (self.HEAD if last else ())
        return [self.get_submodule(n) for n in names] + [self.decoder_layer(i) for i in layer_ids]

    def stage_input_meta(self, micro_local: int, seq_len: int) -> torch.Tensor:
        """The first stage's input per micro-batch on this rank (meta): tokens [b', s]."""
        return torch.empty((micro_local, seq_len), dtype=torch.long, device="meta")

    def stage_output_meta(self, micro_local: int, seq_len: int, mesh,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The last stage's output per micro-batch on this rank (meta): this rank's logits
        block [b', s, V_local] (V_local: the output layer's ``out_local`` where it says it, e.g. a 3D
        tied head, whose weight is the embedding table in the embedding's layout; else from the
        output weight's layout), in ``dtype``: the run's compute dtype, which the head's product
        gives under autocast."""
        vocab_local = getattr(self.get_submodule(self.OUTPUT), "out_local", None)
        if vocab_local is None:
            spec = self.parallel_context.layouts[self.OUTPUT + ".weight"]
            _, sizes = mesh_coords(mesh)
            local = spec.local_shape(sizes)
            vocab_local = local[1] if spec.transposed else local[0]
        return torch.empty((micro_local, seq_len, vocab_local), dtype=dtype, device="meta", requires_grad=True)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's model runs through its stages (gridshard.pipeline.StageModule)")


class RankModel(_RankPart):
    """gridshard's :class:`~gridshard.models.Transformer`: its parts on this rank, its forward pieces."""

    EMBEDDING, LAYERS, HEAD = "embed_tokens", "layers", ("norm", "lm_head")
    embed, layer_inputs, head = Transformer.embed, Transformer.layer_inputs, Transformer.head
    context_split, split_sequence = Transformer.context_split, Transformer.split_sequence     # RoPE positions
    run_layer, hidden_dtype = staticmethod(Transformer.run_layer), staticmethod(Transformer.hidden_dtype)

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        super().__init__(plain, layer_ids, has_first, has_last)
        self.cfg, self.rope_cache = plain.cfg, plain.rope_cache

    def init_laws(self) -> dict:
        """The single-device model's laws for the parameters held here (same names)."""
        return Transformer.init_laws(self)


class HFRankModel(LlamaStagePieces, _RankPart):
    """A Hugging Face Llama-family ``…ForCausalLM``: its parts on this rank under Hugging Face's
    names, with its ``config`` (read by ``parallelize``) and its forward pieces."""

    EMBEDDING, LAYERS, HEAD = "model.embed_tokens", "model.layers", ("model.norm", "lm_head")
    EVERY_STAGE = ("model.rotary_emb",)

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        check_stageable(plain.config.to_dict())
        super().__init__(plain, layer_ids, has_first, has_last)
        self.config = plain.config

    def layout_plan(self):
        """The family's plan with the sequence cut at the embedding: the stages compute positions
        and the mask from the whole length (``layer_inputs``), and a stage without the first
        layer receives its input already cut."""
        from ..parallel.plan import HF_LLAMA_PLAN

        return replace(HF_LLAMA_PLAN, sequence_scatter="embedding")


class ViTRankModel(_RankPart):
    """gridshard's :class:`~gridshard.models.vit.VisionTransformer`: its parts on this rank under
    Hugging Face ``ViTForImageClassification`` names (stage 0: ``vit.embeddings``; the last stage:
    ``vit.layernorm`` and ``classifier``), its forward pieces. The first stage reads images
    [b', C, H, W]; the last stage's output is the logits [b', K], whole on every tensor rank
    (1D: ``Classifier1D``; 2D: grid row i's batch block)."""

    EMBEDDING, LAYERS, HEAD, OUTPUT = "vit.embeddings", "vit.encoder.layer", ("vit.layernorm", "classifier"), \
        "classifier"
    embed, layer_inputs, head = VisionTransformer.embed, VisionTransformer.layer_inputs, VisionTransformer.head
    run_layer = staticmethod(VisionTransformer.run_layer)
    hidden_dtype = staticmethod(VisionTransformer.hidden_dtype)

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        super().__init__(plain, layer_ids, has_first, has_last)
        self.cfg = plain.cfg
        self.holds_layer_0 = 0 in layer_ids

    def init_laws(self) -> dict:
        """The single-device model's laws for the parameters held here (same names)."""
        return VisionTransformer.init_laws(self)

    def layout_plan(self):
        """:data:`VIT_PLAN`; under sequence parallelism the residual stream is cut at layer 0's
        input, so a rank without layer 0 receives its input already cut and installs no cut
        (``sequence_scatter="embedding"``: the ViT's embedding is replicated whatever the flag)."""
        from ..parallel.plan import VIT_PLAN

        return VIT_PLAN if self.holds_layer_0 else replace(VIT_PLAN, sequence_scatter="embedding")

    def stage_input_meta(self, micro_local: int, seq_len: int) -> torch.Tensor:
        """Images [b', C, H, W] (fp32, as the data gives them)."""
        c = self.cfg
        return torch.empty((micro_local, c.channels, c.image_size, c.image_size), device="meta")

    def stage_output_meta(self, micro_local: int, seq_len: int, mesh,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logits [b', K], whole on every tensor rank, in the compute dtype ``dtype``."""
        return torch.empty((micro_local, self.cfg.num_classes), dtype=dtype, device="meta", requires_grad=True)
