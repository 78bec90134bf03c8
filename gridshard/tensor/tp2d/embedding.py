"""Token embeddings producing the 2D activation layout [b/q, s, h/q] at rank (i, j).

Both take this rank's tokens [b/q, s] (batch block i, see ``ParallelContext.shard_tokens``)
and return x[batch block i, :, hidden block j]. The global table is drawn as
[vocab, hidden] with ``normal_(0, init_std)`` (init contract of :mod:`gridshard.testing.plain`).

``VocabParallelEmbedding2D`` (the LM's embedding): table padded to V_pad = ⌈V/q⌉·q
rows (padding rows zero, appended after drawing, never looked up), block (i, j) =
W[vocab block i, hidden block j], [V_pad/q, h/q] per rank.

    1. all-gather the int tokens along the column → every rank of column j has the
       whole batch [b, s] (payload b·s·8 bytes); the id range is checked on these
       gathered tokens, which every rank of the grid holds alike, so a bad id in any
       batch block raises the same error on every rank (never on one grid row alone,
       which would leave the others waiting in the reduce-scatter);
    2. look up the tokens that fall in my vocab block i (others give 0) → a partial
       [b, s, h/q] (hidden block j, summed over vocab blocks it is complete);
    3. reduce-scatter along the column on the batch dim → member i keeps batch
       block i, summed over the q vocab blocks: [b/q, s, h/q].

    Backward: all-gather of the output gradient along the column (b·s·h/q
    elements), then a local masked embedding backward: the exact gradient of
    W[vocab block i, hidden block j]. This table can also serve as a tied LM head
    (:class:`gridshard.tensor.tp2d.classifier.TiedVocabHead2D`, a SUMMA A·Bᵀ).

``Embedding2D``: full vocabulary, hidden split into q² blocks: rank (i, j) stores
W[:, sub-block i of hidden block j] [V, h/q²]. Forward agrees on the token range (each
batch block's verdict summed along the column, 16·q bytes, :mod:`gridshard.nn.id_range`),
all-gathers the table along the column to [V, h/q] (hidden block j) and looks up its own
tokens; backward
reduce-scatters the table gradient (summing the q batch blocks). Needs h % q² = 0
and holds a transient [V, h/q] table: use it for small vocabularies (ViT/classes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import collectives as C
from ...comm.grid_ops import gather_along
from ...errors import check_divisible
from ...nn.id_range import bad_id_slots, raise_on_bad_ids
from ...nn.sharding import ShardSpec, sharded_parameter
from ..grid_embedding import GridVocabEmbedding, check_token_ids
from ..hidden_cut import normal_init
from .linear import hidden_cut_2d


class VocabParallelEmbedding2D(GridVocabEmbedding):
    """Vocabulary split over grid rows, hidden over grid columns (see module docstring;
    :mod:`gridshard.tensor.grid_embedding` with the grid column as ``gather``)."""

    hidden_cut = staticmethod(hidden_cut_2d)


class Embedding2D(nn.Module):
    """Full vocabulary, hidden split into q² blocks (see module docstring)."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32):
        super().__init__()
        q = mesh.q
        check_divisible(hidden, q * q, "hidden (Embedding2D splits it into q² blocks)", "q²",
                        f"use hidden a multiple of {q * q}, or VocabParallelEmbedding2D")
        self.mesh, self.vocab, self.hidden = mesh, vocab, hidden
        spec = ShardSpec((vocab, hidden), ((1, "grid_col"), (1, "grid_row")))
        self.weight = sharded_parameter(spec, mesh, normal_init(init_std), dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_token_ids(tokens)
        verdict = bad_id_slots(tokens, self.vocab, self.mesh.grid_row, self.mesh.q)
        raise_on_bad_ids(C.all_reduce(verdict, self.mesh.col, inplace=True), self.vocab, "Embedding2D tokens")
        table = gather_along(self.weight, self.mesh.col, 1)  # [V, h/q], hidden block j
        return F.embedding(tokens, table)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, hidden={self.hidden}, q={self.mesh.q}"
