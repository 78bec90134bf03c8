"""Vocabulary-parallel embedding (Megatron 1D), with optional sequence parallelism.

Global table E [V, h] drawn ``normal_(0, init_std)`` (init contract), then padded
with zero rows to V_p = ⌈V/T⌉·T so it splits evenly: rank t holds the rows
[t·V_p/T, (t+1)·V_p/T), a [V_p/T, h] block. Padding rows are never looked up (token
ids are checked to be < V) and stay zero, so padding never changes a result.

Forward for tokens [b, s] (the full, replicated token ids):

    e_t[i] = E_t[tok_i − start_t]   if start_t ≤ tok_i < end_t   else 0      [b, s, h]
    out    = Σ_t e_t                  (all-reduce of b·s·h·bytes)

Every token is owned by exactly one rank, so the sum is the plain lookup. Under
sequence parallelism the sum is reduce-scattered along the sequence instead,
giving this rank's block [b, s/T, h] (reduce-scatter of b·s·h·bytes; backward
all-gather of b·s·h·bytes). The lookup is then done on the transposed ids [s, b], so the
partial sum is stored sequence-first and the reduce-scatter reads it in place; the block
comes out sequence-first, the layout of the whole SP region (:mod:`gridshard.comm.dual_ops`). Without SP the backward needs no communication: every
rank already holds the full output gradient and scatters it into its own rows.

``sequence_parallel`` is a fact the layer is told (``parallelize`` passes it already in
effect), read through the job layout's one rule
(:meth:`gridshard.job_layout.TensorMode.sequence_parallel_in_effect`: off at T = 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.dual_ops import reduce_from_group, reduce_scatter_sequence
from ...errors import ShapeError
from .linear import check_sequence_divisible
from ...theory.vocab import padded_vocab_size
from ...nn.sharding import ShardSpec, sharded_parameter, sequence_parallel_on
from ...torch_private import assert_async


def padded_normal_init(vocab_size: int, std: float):
    """Init of a padded [V_p, h] table: draw the real [V, h] rows ``normal_(0, std)`` exactly as
    an unpadded table would (same RNG stream), then zero the padding rows."""
    def init(full: torch.Tensor) -> None:
        full[:vocab_size].normal_(0.0, std)
        full[vocab_size:].zero_()
    return init


def check_token_range(ids: torch.Tensor, vocab_size: int, what: str, ignore_index=None) -> None:
    """ShapeError if an id (other than ``ignore_index``) lies outside [0, vocab_size)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ShapeError(f"{what}: ids must be an integer tensor, got dtype {ids.dtype}. Fix: pass .long() ids.")
    if ids.numel() == 0:
        return
    if ids.is_cuda:
        # no host sync on the GPU hot path: a device-side assert fires on a bad id
        ok = (ids >= 0) & (ids < vocab_size)
        if ignore_index is not None:
            ok |= ids == ignore_index
        assert_async(ok.all(), f"{what}: an id lies outside the vocabulary [0, {vocab_size})")
        return
    live = ids if ignore_index is None else ids[ids != ignore_index]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= vocab_size):
        bad = int(live.max()) if int(live.max()) >= vocab_size else int(live.min())
        raise ShapeError(f"{what}: id {bad} is outside the vocabulary [0, {vocab_size}). Fix: check the "
                         f"tokenizer / vocab_size (and ignore_index={ignore_index}).")


class VocabParallelEmbedding(nn.Module):
    """Tokens [b, s] → embeddings [b, s, h] (or the sequence block [b, s/T, h] under SP).

    Attributes: ``vocab_size`` (V), ``padded_vocab`` (V_p), ``vocab_start``/``vocab_end``
    (this rank's row range in the padded table), ``weight`` [V_p/T, h] with spec
    ``ShardSpec((V_p, h), ((0, "tensor"),))``.
    """

    def __init__(self, vocab_size: int, hidden: int, mesh, init_std: float = 0.02, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.axis = mesh.tensor
        T = self.axis.size
        self.vocab_size, self.hidden = vocab_size, hidden
        self.padded_vocab = padded_vocab_size(vocab_size, T)
        per_rank = self.padded_vocab // T
        self.vocab_start = self.axis.rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        spec = ShardSpec((self.padded_vocab, hidden), ((0, "tensor"),), canonical_shape=(vocab_size, hidden))
        self.weight = sharded_parameter(spec, mesh, padded_normal_init(vocab_size, init_std), dtype, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        name = "VocabParallelEmbedding"
        check_token_range(tokens, self.vocab_size, name)
        if self.sequence_parallel:
            if tokens.dim() != 2:
                raise ShapeError(f"{name}: sequence parallelism needs tokens [batch, seq], got shape "
                                 f"{tuple(tokens.shape)}. Fix: pass a 2-D token tensor.")
            check_sequence_divisible(tokens.unsqueeze(-1), self.axis.size, name)
        if self.axis.size == 1:
            return F.embedding(tokens, self.weight)
        if self.sequence_parallel:                 # look up [s, b]: the partial is stored sequence-first
            tokens = tokens.t()
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial.transpose(0, 1), self.axis, 1)
        return reduce_from_group(partial, self.axis)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab}, local rows "
                f"[{self.vocab_start}, {self.vocab_end})), hidden={self.hidden}, "
                f"sequence_parallel={self.sequence_parallel}")
