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
:class:`gridshard.models.hf_stages.LlamaStagePieces`), so there is one description of the
forward (:class:`gridshard.pipeline.stage_module.StageModule`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from torch import nn

from ..models.hf_stages import LlamaStagePieces, check_stageable
from ..models.llama import Transformer


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
    stage calls, e.g. a rotary embedding), ``HEAD`` (final norm and LM head)."""

    EMBEDDING: str
    LAYERS: str
    EVERY_STAGE: tuple = ()
    HEAD: tuple

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        super().__init__()
        self.has_first, self.has_last = has_first, has_last
        embedding = plain.get_submodule(self.EMBEDDING)
        tied = plain.get_submodule("lm_head").weight is embedding.weight
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

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's model runs through its stages (gridshard.pipeline.StageModule)")


class RankModel(_RankPart):
    """gridshard's :class:`~gridshard.models.Transformer`: its parts on this rank, its forward pieces."""

    EMBEDDING, LAYERS, HEAD = "embed_tokens", "layers", ("norm", "lm_head")
    embed, layer_inputs, head = Transformer.embed, Transformer.layer_inputs, Transformer.head
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
