"""Megatron 1D tensor parallelism (optionally with sequence parallelism) as a model style.

Layouts per rank (see the table in :mod:`gridshard.nn.style`):

* residual stream: [b, s, h] replicated; with sequence parallelism (SP) the sequence
  block t, [b, s/T, h];
* split layout: [b, s, n/T] — whole heads / whole MLP neurons, full sequence;
* tokens and targets: the full [b, s] on every tensor rank (the embedding keeps its
  vocabulary rows and, under SP, reduce-scatters to the sequence block; the head
  gathers the sequence back, so logits are [b, s, V_p/T]).

One block (attention: qkv column, proj row; MLP: gate|up column, down row) moves,
per forward+backward and with A = b·s·h·bytes:

* no SP: 2 all-reduces of A forward (row outputs) + 2 backward (column inputs);
* SP: 2 all-gathers + 2 reduce-scatters of A forward, the same backward, plus one
  all-reduce of h·bytes per norm weight (2 per block) for the partial norm gradients.

The formulas are :mod:`gridshard.theory.tp1d` and are asserted against the ledger.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..errors import LayoutError, check_divisible
from .cross_entropy_1d import vocab_parallel_cross_entropy
from .embedding_1d import VocabParallelEmbedding, padded_normal_init, padded_vocab_size
from .linear_1d import T_NAME, ColumnParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .style import TensorParallelStyle


class Megatron1DStyle(TensorParallelStyle):
    """Column/row-parallel layers over ``mesh.tensor`` (T ranks), SP optional."""

    mode = "1d"

    def __init__(self, mesh, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(mesh, sequence_parallel)
        if mesh.tensor_mode == "2d":
            raise LayoutError("Megatron1DStyle on a 2D mesh: the 1D style splits over the flat tensor axis and "
                              "would ignore the q×q grid. Fix: build the mesh with tensor_mode='1d' or use "
                              "Summa2DStyle.")
        self.T = mesh.tensor.size
        self.dtype, self.device = dtype, device
        self.vocab_size: Optional[int] = None       # set by embedding()/lm_head(); the loss masks padding

    # ---- sizes and data layout -------------------------------------------------
    def split_size(self, n: int, what: str) -> int:
        check_divisible(n, self.T, what, T_NAME)
        return n // self.T

    def shard_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens and targets stay whole [b, s] on every tensor rank (also under SP)."""
        return tokens

    def check_shapes(self, batch: int, seq: int, hidden: int, heads: int, ffn: int, vocab: int) -> None:
        check_divisible(hidden, heads, "hidden", "heads", "choose hidden = heads × head_dim")
        check_divisible(hidden, self.T, "hidden", T_NAME)
        check_divisible(heads, self.T, "heads", T_NAME, "each rank must hold whole attention heads")
        check_divisible(ffn, self.T, "ffn_hidden", T_NAME)
        check_divisible(hidden // heads, 2, "head_dim (hidden/heads)", "2",
                        "rotary embeddings rotate channel pairs: choose an even head_dim")
        if self.sequence_parallel:
            check_divisible(seq, self.T, "seq (sequence length)", T_NAME,
                            f"use a multiple of {self.T}, or turn sequence_parallel off")

    # ---- layers --------------------------------------------------------------------
    def embedding(self, vocab: int, hidden: int, init_std: float) -> nn.Module:
        self.vocab_size = vocab
        return VocabParallelEmbedding(vocab, hidden, self.mesh, init_std, self.sequence_parallel,
                                      dtype=self.dtype, device=self.device)

    def norm(self, hidden: int, eps: float) -> nn.Module:
        return RMSNorm(hidden, eps, self.mesh, self.sequence_parallel, dtype=self.dtype, device=self.device)

    def column_linear(self, in_features, out_features, bias, init_std, fused_parts=1):
        return ColumnParallelLinear(in_features, out_features, self.mesh, bias=bias, gather_output=False,
                                    sequence_parallel=self.sequence_parallel, init_std=init_std,
                                    fused_parts=fused_parts, dtype=self.dtype, device=self.device)

    def row_linear(self, in_features, out_features, bias, init_std):
        return RowParallelLinear(in_features, out_features, self.mesh, bias=bias, input_is_parallel=True,
                                 sequence_parallel=self.sequence_parallel, init_std=init_std,
                                 dtype=self.dtype, device=self.device)

    def lm_head(self, hidden, vocab, init_std, tied=None):
        """ColumnParallelLinear [V_p, h] without gather (logits [b, s, V_p/T]); under SP its
        input is gathered along the sequence. ``tied``: a VocabParallelEmbedding whose
        weight (same spec, same rows on this rank) is shared; nothing is drawn then."""
        self.vocab_size = vocab
        padded = padded_vocab_size(vocab, self.T)
        shared = None
        if tied is not None:
            if not isinstance(tied, VocabParallelEmbedding) or tied.vocab_size != vocab or tied.hidden != hidden:
                raise LayoutError(f"lm_head(tied=...): expected the VocabParallelEmbedding({vocab}, {hidden}) of this "
                                  f"model, got {tied!r}. Fix: tie to the model's own embedding.")
            shared = tied.weight
        return ColumnParallelLinear(hidden, padded, self.mesh, bias=False, gather_output=False,
                                    sequence_parallel=self.sequence_parallel, init_std=init_std,
                                    dtype=self.dtype, device=self.device,
                                    weight_init=padded_normal_init(vocab, init_std), shared_weight=shared)

    def loss(self, logits, targets, ignore_index=-100):
        """Mean over the non-ignored tokens of the per-token vocab-parallel cross-entropy
        (NaN when every token is ignored, like ``F.cross_entropy``)."""
        per_token = vocab_parallel_cross_entropy(logits, targets, self.mesh.tensor, ignore_index,
                                                 vocab_size=self.vocab_size)
        n_valid = (targets != ignore_index).sum()
        return per_token.sum() / n_valid
