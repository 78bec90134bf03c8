"""Vocabulary-parallel token embedding producing a 3D activation layout [b/q², s, h/q].

On a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation, rank (i, j, l) takes its tokens
[b/q², s] (batch block i·q + j, :meth:`Mesh3D.batch_block` with ``hidden=False``) and returns
x[batch block i·q + j, :, hidden block l].

Table (global [V, h] drawn ``normal_(0, init_std)``, zero rows appended to V_pad = ⌈V/q²⌉·q²,
never looked up): rank (i, j, l) holds E[vocab block i·q + j of q², hidden block l of q],
[V_pad/q², h/q] (1/T of the table). The q² ranks of ``mesh.batch`` hold hidden block l between
them, one vocab block each — the 2D vocab-parallel embedding with ``batch`` (q² ranks) in the
role of the grid column:

    1. all-gather the int tokens over ``batch`` → every rank holds the whole micro-batch [b, s]
       (b·s·8 bytes); the id range is checked on it locally, alike on every rank of the cube
       (:func:`gridshard.nn.id_range.check_blocks`: the error names the batch block), so no rank
       raises alone while another waits in the next collective;
    2. look up the tokens in my vocab block (others give 0) → a partial [b, s, h/q];
    3. reduce-scatter over ``batch`` on the batch dim → member i·q + j keeps batch block
       i·q + j, summed over the q² vocab blocks: [b/q², s, h/q].

Backward: the reduce-scatter's dual all-gathers the output gradient over ``batch``
(b·s·h/q·e), then a local masked embedding backward gives the exact gradient of my table block.
Communication: :func:`gridshard.tensor.tp3d.theory.embedding3d_comm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import collectives as C
from ...comm.grid_ops import reduce_scatter_along
from ...errors import ShapeError, check_divisible
from ...theory.vocab import padded_vocab_size
from ..tp2d.embedding import padded_table_init
from ...nn.id_range import check_blocks
from .linear import sharded_parameter_3d
from ...nn.sharding import ShardSpec


def table_spec_3d(vocab: int, padded: int, hidden: int, mesh) -> ShardSpec:
    """[V_pad, h] table: vocab block weight·q + input (= ``mesh.batch`` member), hidden block output."""
    return ShardSpec((padded, hidden), ((0, "weight"), (0, mesh.input.name), (1, mesh.output.name)),
                     canonical_shape=(vocab, hidden))


class VocabParallelEmbedding3D(nn.Module):
    """Vocabulary split over ``mesh.batch`` (q² blocks), hidden over ``mesh.output`` (module docstring)."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        q = mesh.q
        check_divisible(hidden, q, "hidden", "cube side q")
        self.mesh, self.vocab, self.hidden = mesh, vocab, hidden
        self.padded_vocab = padded_vocab_size(vocab, q * q)
        self.vocab_local = self.padded_vocab // (q * q)
        self.vocab_start = mesh.batch_index * self.vocab_local
        spec = table_spec_3d(vocab, self.padded_vocab, hidden, mesh)
        self.weight = sharded_parameter_3d(spec, mesh, padded_table_init(vocab, hidden, init_std, self.padded_vocab),
                                           dtype, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ShapeError(f"embedding tokens must be integer ids, got dtype {tokens.dtype}. Fix: pass a LongTensor.")
        n = self.mesh.q ** 2
        all_tokens = C.all_gather(tokens.contiguous(), self.mesh.batch, 0)       # [b, s] on every rank
        check_blocks(all_tokens, self.vocab, "VocabParallelEmbedding3D tokens", n)   # alike on every rank
        local = all_tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        part = F.embedding(local.masked_fill(outside, 0), self.weight)           # [b, s, h/q]
        part = part.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along(part, self.mesh.batch, 0)                    # [b/q², s, h/q]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab} (padded {self.padded_vocab}), hidden={self.hidden}, q={self.mesh.q}"
