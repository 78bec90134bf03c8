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
from ...comm.grid_ops import gather_along, reduce_scatter_along
from ...errors import ShapeError, check_divisible
from ...nn.id_range import bad_id_slots, check_blocks, raise_on_bad_ids
from ...theory.vocab import padded_vocab_size as padded_vocab
from ...nn.sharding import ShardSpec, sharded_parameter


def padded_table_init(vocab: int, hidden: int, std: float, padded: int):
    """Draw [vocab, hidden] ~ N(0, std²) and append ``padded − vocab`` zero rows."""
    def init(full: torch.Tensor) -> None:
        full.zero_()
        full[:vocab].copy_(torch.empty(vocab, hidden).normal_(0.0, std))
    return init


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"embedding tokens must be integer ids, got dtype {tokens.dtype}. Fix: pass a LongTensor.")


class VocabParallelEmbedding2D(nn.Module):
    """Vocabulary split over grid rows, hidden over grid columns (see module docstring)."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        q = mesh.q
        check_divisible(hidden, q, "hidden", "grid side q")
        self.mesh, self.vocab, self.hidden = mesh, vocab, hidden
        self.padded_vocab = padded_vocab(vocab, q)
        self.vocab_local = self.padded_vocab // q
        self.vocab_start = mesh.grid_row * self.vocab_local
        spec = ShardSpec((self.padded_vocab, hidden), ((0, "grid_row"), (1, "grid_col")),
                         canonical_shape=(vocab, hidden))
        self.weight = sharded_parameter(spec, mesh, padded_table_init(vocab, hidden, init_std, self.padded_vocab),
                                        dtype, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens)
        all_tokens = C.all_gather(tokens, self.mesh.col, 0)           # [b, s] on every rank of column j
        check_blocks(all_tokens, self.vocab, "VocabParallelEmbedding2D tokens", self.mesh.q)   # alike on every rank
        local = all_tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        part = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h/q]
        part = part.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along(part, self.mesh.col, 0)             # [b/q, s, h/q]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab} (padded {self.padded_vocab}), hidden={self.hidden}, q={self.mesh.q}"


class Embedding2D(nn.Module):
    """Full vocabulary, hidden split into q² blocks (see module docstring)."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32):
        super().__init__()
        q = mesh.q
        check_divisible(hidden, q * q, "hidden (Embedding2D splits it into q² blocks)", "q²",
                        f"use hidden a multiple of {q * q}, or VocabParallelEmbedding2D")
        self.mesh, self.vocab, self.hidden = mesh, vocab, hidden
        spec = ShardSpec((vocab, hidden), ((1, "grid_col"), (1, "grid_row")))
        self.weight = sharded_parameter(spec, mesh, lambda full: full.normal_(0.0, init_std), dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens)
        verdict = bad_id_slots(tokens, self.vocab, self.mesh.grid_row, self.mesh.q)
        raise_on_bad_ids(C.all_reduce(verdict, self.mesh.col, inplace=True), self.vocab, "Embedding2D tokens")
        table = gather_along(self.weight, self.mesh.col, 1)  # [V, h/q], hidden block j
        return F.embedding(tokens, table)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, hidden={self.hidden}, q={self.mesh.q}"
