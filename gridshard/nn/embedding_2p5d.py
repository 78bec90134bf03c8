"""2.5D token embeddings: the 2D embeddings on my depth layer's grid, with the token range
agreed over all d·q batch blocks first and the table gradient summed over depth.

Rank (k, i, j) takes its tokens [b/(d·q), s] (batch block k·q + i) and returns
x[batch block k·q + i, :, hidden block j] = [b/(d·q), s, h/q].

``VocabParallelEmbedding2p5D``: :class:`gridshard.nn.embedding_2d.VocabParallelEmbedding2D` on
``mesh.grid`` (table block (i, j) = W[vocab block i, hidden block j], [V_pad/q, h/q], the same
on every depth layer): column all-gather of the layer's tokens, masked local lookup,
column reduce-scatter. ``Embedding2p5D``: :class:`gridshard.nn.embedding_2d.Embedding2D` on
``mesh.grid`` (full vocabulary, h/q² columns per rank).

Token range, agreed by every rank (d > 1): the 2D layers agree on the range within one
depth layer only; a layer that raised alone would leave the other d − 1 layers running on
into the next collective that spans depth (the loss, the gradient sums) and waiting there.
So before the 2D layer, each rank puts its block's verdict into slot k·q + i of a float64
vector of 2·d·q entries (:func:`gridshard.nn.id_range.bad_id_slots`) and all-reduces it over
``depth_col`` (my grid column in every layer: every batch block exactly once), 16·d·q bytes;
every rank then raises the same error or none (:func:`check_ids_2p5d`). With d = 1 the
2D layer's own check suffices and nothing is added (the layer is 2D bit for bit).

Backward: the 2D layer's, then the table gradient (a partial sum over my layer's tokens) is
all-reduced over ``depth`` (:mod:`gridshard.comm.depth_ops`): V_pad·h/q²·e (vocab-parallel)
or V·h/q²·e bytes.
"""
from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.depth_ops import reduce_grads_over_depth
from .embedding_2d import Embedding2D, VocabParallelEmbedding2D, _check_tokens
from .id_range import bad_id_slots, raise_on_bad_ids


def id_verdict_2p5d(ids: torch.Tensor, vocab_size: int, mesh, ignore_index=None) -> torch.Tensor:
    """My batch block's verdict slots [2·d·q] (slot k·q + i), not yet summed."""
    return bad_id_slots(ids, vocab_size, mesh.batch_index, mesh.d * mesh.q, ignore_index)


def check_ids_2p5d(ids: torch.Tensor, vocab_size: int, mesh, what: str, ignore_index=None) -> None:
    """Raise the same :class:`gridshard.errors.ShapeError` on every rank of the 2.5D group when
    any batch block holds an id outside [0, vocab_size) (one ``depth_col`` all-reduce of
    16·d·q bytes; nothing when d = 1)."""
    if mesh.d == 1:
        return
    if ignore_index is None:
        _check_tokens(ids)
    summed = C.all_reduce(id_verdict_2p5d(ids, vocab_size, mesh, ignore_index), mesh.depth_col, inplace=True)
    raise_on_bad_ids(summed, vocab_size, what, ignore_index)


class VocabParallelEmbedding2p5D(VocabParallelEmbedding2D):
    """Vocabulary split over grid rows, hidden over grid columns, replicated over depth."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, **kwargs):
        super().__init__(vocab, hidden, mesh.grid, init_std, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_ids_2p5d(tokens, self.vocab, self.mesh_2p5d, "VocabParallelEmbedding2p5D tokens")
        return super().forward(tokens)


class Embedding2p5D(Embedding2D):
    """Full vocabulary, hidden split into q² blocks, replicated over depth."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, **kwargs):
        super().__init__(vocab, hidden, mesh.grid, init_std, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_ids_2p5d(tokens, self.vocab, self.mesh_2p5d, "Embedding2p5D tokens")
        return super().forward(tokens)
