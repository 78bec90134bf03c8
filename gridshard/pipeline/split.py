"""Which layers each pipeline stage holds, and the module a rank builds for its stages.

With P pipeline ranks and V virtual stages per rank there are S = P·V stages. Stage s
holds a contiguous run of decoder layers; stage 0 also the embedding, stage S−1 also the
final norm and the LM head. Default split (:func:`stage_layer_counts`): the L layers as
evenly as possible with the embedding and the head counted as one layer each of work —
the first and last stages get one layer less when that evens the load, i.e. the counts
are the even split of L + 2 "units" with the first and last stage's extra unit removed.
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

from typing import Optional, Sequence

from torch import nn

from ..errors import ConfigError


def stage_layer_counts(layers: int, stages: int, explicit: Optional[Sequence[int]] = None) -> list:
    """Decoder layers per stage (module docstring). ConfigError when a stage would get none
    or the explicit counts do not add up."""
    if explicit is not None:
        explicit = list(explicit)
        if len(explicit) != stages or sum(explicit) != layers or min(explicit) < 0:
            raise ConfigError(f"parallel.stage_layers={explicit} is invalid: it needs {stages} counts "
                              f"(pipeline × virtual_stages), each ≥ 0, adding up to model.layers={layers}. Fix: "
                              f"list {stages} layer counts that sum to {layers}, or remove it for an even split.")
        return explicit
    if layers < stages:
        raise ConfigError(f"parallel.pipeline × virtual_stages = {stages} stages but model.layers={layers}: every "
                          f"stage needs at least one decoder layer. Fix: use at most {layers} stages, or a deeper "
                          f"model.")
    units = layers + 2                                 # + embedding and head, one unit of work each
    base, extra = divmod(units, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    counts[0] -= 1
    counts[-1] -= 1
    if stages == 1:
        counts = [layers]
    # never leave a stage without a layer: move one from the largest neighbour
    for s in range(stages):
        while counts[s] < 1:
            donor = max(range(stages), key=lambda i: counts[i])
            counts[donor] -= 1
            counts[s] += 1
    assert sum(counts) == layers
    return counts


def stage_layer_ids(counts: Sequence[int]) -> list:
    """Global layer indices of every stage."""
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def stages_of_rank(pipeline_rank: int, pipeline: int, virtual: int) -> list:
    """The stage indices pipeline rank r runs: r, r+P, …, r+(V−1)P."""
    return [pipeline_rank + v * pipeline for v in range(virtual)]


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
