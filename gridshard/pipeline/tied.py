"""Tied embeddings across the first and the last pipeline stage.

With ``tie_embeddings`` the LM head's weight *is* the embedding table. When stage 0 and
stage S−1 sit on different pipeline ranks (pipeline rank 0 and P−1), each holds a copy of
the embedding weight (the family's name: ``embed_tokens.weight``, Hugging Face's
``model.embed_tokens.weight``) — equal at initialisation (the value is a function of the
name) — and each copy gets only its own use's gradient: the embedding's on the first, the head's on
the last. Summing the two (one all-reduce over the pair of ranks with the same data and
tensor coordinates, V_p·h/T floats in 1D) gives both the gradient of the single-device
tied weight, so the two copies take the same optimizer step and stay equal (Megatron's
scheme). The gradient norm counts the weight once (on the first stage,
:meth:`TiedEmbeddingSync.counted`).
"""
from __future__ import annotations

import itertools

import torch.distributed as dist

from ..comm import collectives as C
from ..mesh import Axis, group_timeout_s, set_collective_timeout


def holds_tied_copy(rank_model, pipeline: int, tied: bool) -> bool:
    """Whether this rank holds one of the two copies of a cross-stage tied embedding (P > 1, tied,
    first or last stage): the ranks :class:`TiedEmbeddingSync` pairs, whose ZeRO root unit waits for
    the pair's sum (``build_reducer(defer_root=...)``)."""
    return pipeline > 1 and tied and (rank_model.has_first or rank_model.has_last)


class TiedEmbeddingSync:
    def __init__(self, rank_model, mesh, tied: bool):
        self.param, self.axis, self.drop_from_norm = None, None, False
        P = mesh.pipeline.size
        if not tied or P == 1:
            return
        grid = mesh.device_mesh.mesh                   # (D, P, T) or (D, P, q, q) global ranks
        me = dist.get_rank()
        tensor_index = itertools.product(*(range(n) for n in grid.shape[2:]))
        for d, t in itertools.product(range(grid.shape[0]), list(tensor_index)):
            ranks = (int(grid[(d, 0, *t)]), int(grid[(d, P - 1, *t)]))
            group = dist.new_group(list(ranks))         # every rank creates every pair, in the same order
            if me in ranks:
                self.axis = Axis("pipeline_tied", 2, ranks.index(me), ranks, group, mesh.ledger)
                timeout = group_timeout_s(dist.group.WORLD)       # the world's, not torch's default
                if timeout is not None:
                    set_collective_timeout([group], timeout)
        if self.axis is not None:
            self.param = rank_model.get_parameter(rank_model.embedding_weight_name)     # the family's name
            self.drop_from_norm = not rank_model.has_first     # the last stage's copy is not counted twice

    def groups(self) -> list:
        """This rank's tied pair's process group, if it is in one."""
        return [self.axis.group] if self.axis is not None else []

    def sync(self) -> None:
        """Sum the two copies' gradients (no-op without a cross-stage tie)."""
        if self.axis is not None and self.param.grad is not None:
            C.all_reduce(self.param.grad, self.axis, inplace=True)

    def counted(self, params) -> list:
        """``params`` without the last stage's copy of the tied weight."""
        return [p for p in params if not (self.drop_from_norm and p is self.param)]
