"""Which layers each pipeline stage holds, and the module a rank builds for its stages.

With P pipeline ranks and V virtual stages per rank there are S = P·V stages. Stage s
holds a contiguous run of decoder layers; stage 0 also the embedding, stage S−1 also the
final norm and the LM head. The split itself is a job-layout fact
(:class:`gridshard.job_layout.StageSplit`, default counts :func:`stage_layer_counts`),
decided there once for the builder, the runner, validation and the planner;
``parallel.stage_layers`` overrides it with explicit counts.

Stage s lives on pipeline rank s mod P (``interleaved``: stages r, r+P, r+2P, … on rank r),
so V = 1 is the usual one stage per rank.

Parameter names never change: a rank builds one :class:`RankModel` holding the
embedding (if it has stage 0), its layers under their global index (``layers.7.…``), and
the final norm and head (if it has stage S−1) — the single-device model's names and
shapes, so :func:`gridshard.parallelize` gives every parameter the value it has in the
single-device model (initialisation is a function of the name) and checkpoints do not
depend on P. With tied embeddings the last stage also holds ``embed_tokens.weight`` (the
head's weight); its gradient is summed with the first stage's (:mod:`.tied`).
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..job_layout import stage_layer_counts, stage_layer_ids, stages_of_rank  # noqa: F401  (the split's home)


class RankModel(nn.Module):
    """The parts of the plain model one pipeline rank holds, under their single-device names
    (module docstring). Built from a plain :class:`gridshard.models.Transformer` (on meta);
    the modules are taken from it, not copied."""

    def __init__(self, plain, layer_ids: Sequence[int], has_first: bool, has_last: bool):
        super().__init__()
        self.cfg = plain.cfg
        self.has_first, self.has_last = has_first, has_last
        tied = plain.cfg.tie_embeddings
        if has_first or (has_last and tied):
            self.embed_tokens = plain.embed_tokens
        self.layers = nn.ModuleDict({str(i): plain.layers[i] for i in layer_ids})
        if has_last:
            self.norm = plain.norm
            self.lm_head = plain.lm_head
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    def init_laws(self) -> dict:
        """The single-device model's laws for the parameters held here (same names)."""
        from ..models.llama import Transformer

        return Transformer.init_laws(self)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a RankModel runs through its pipeline stages (gridshard.pipeline.StageModule)")
