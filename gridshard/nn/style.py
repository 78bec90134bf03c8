"""Tensor-parallel *styles*: how the one reference model builds its layers per tensor mode.

The model (``gridshard.models``) is written once against :class:`TensorParallelStyle`;
each tensor mode supplies an implementation:

==========  ==========================  ==============================  ===================
mode        residual layout (per rank)  split layout (per rank)          tokens/targets
==========  ==========================  ==============================  ===================
none        [b, s, h]                   [b, s, n]                        [b, s]
1d          [b, s, h]                   [b, s, n/T]                      [b, s]
1d + SP     [b, s/T, h] (seq block t)   [b, s, n/T]                      [b, s]
2d          [b/q, s, h/q] (i, j)        [b/q, s, n/q] (i, j)              [b/q, s] (block i)
==========  ==========================  ==============================  ===================

* *residual layout*: the hidden stream between blocks (embeddings, norms, residual adds).
* *split layout*: output of ``column_linear`` / input of ``row_linear`` — the dimension
  n of the projection (heads × head_dim, or the MLP width) split over the tensor ranks,
  with the full sequence, so attention and SwiGLU run locally on whole heads/neurons.
* 2D: rank (i, j) of the q×q grid holds batch block i and hidden block j.

Initialisation contract (so the same seed gives the same global model in every
mode and at every T): every layer draws its *global* parameters from torch's default
RNG, in construction order, with these shapes and laws, then keeps its shard
(:func:`gridshard.nn.sharding.sharded_parameter`):

* linear weight: global [out, in] (PyTorch convention, even when a layer stores the
  transpose), ``normal_(0, init_std)``; bias: zeros.
* embedding / lm-head weight: global [vocab, hidden], ``normal_(0, init_std)``;
  vocabulary padding rows (when vocab % T ≠ 0) are appended *after* drawing and are zero.
* norm weight: ones.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn
from torch.nn.utils import skip_init  # no RNG draws at construction: see the init contract


class TensorParallelStyle(ABC):
    """Factory of the model's layers for one tensor mode on one mesh."""

    mode: str = "abstract"

    def __init__(self, mesh, sequence_parallel: bool = False):
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel

    # ---- sizes and data layout -------------------------------------------------
    @abstractmethod
    def split_size(self, n: int, what: str) -> int:
        """Local size of a dimension n that column layers split (heads, MLP width);
        raises ShapeError naming ``what`` if n is not divisible."""

    @abstractmethod
    def shard_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Global tokens or targets [b, s] → what this rank feeds the model / the loss."""

    @abstractmethod
    def check_shapes(self, batch: int, seq: int, hidden: int, heads: int, ffn: int, vocab: int) -> None:
        """Raise ShapeError (before any collective) if the model cannot be laid out."""

    # ---- layers --------------------------------------------------------------------
    @abstractmethod
    def embedding(self, vocab: int, hidden: int, init_std: float) -> nn.Module:
        """Local tokens → residual layout."""

    @abstractmethod
    def norm(self, hidden: int, eps: float) -> nn.Module:
        """RMSNorm in the residual layout (weight ones)."""

    @abstractmethod
    def column_linear(self, in_features: int, out_features: int, bias: bool, init_std: float,
                      fused_parts: int = 1) -> nn.Module:
        """Residual layout [.., in] → split layout [.., out/T]. ``fused_parts`` = 2 (gate|up)
        or 3 (q|k|v): each part is split separately so a rank's local output is
        [part₀ block, part₁ block, …] and ``chunk(fused_parts, -1)`` recovers them."""

    @abstractmethod
    def row_linear(self, in_features: int, out_features: int, bias: bool, init_std: float) -> nn.Module:
        """Split layout [.., in/T] → residual layout [.., out]."""

    @abstractmethod
    def lm_head(self, hidden: int, vocab: int, init_std: float, tied: nn.Module | None = None) -> nn.Module:
        """Residual layout → this rank's logits (a vocabulary shard in 1D/2D).
        ``tied``: the embedding module whose weight to share, when supported."""

    @abstractmethod
    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over all *global* non-ignored tokens of the tensor group's
        batch; the same scalar on every tensor rank; never materialises full-vocab logits."""


class NoTensorParallel(TensorParallelStyle):
    """Plain single-device layers (T = 1); the reference every other style must match."""

    mode = "none"

    def split_size(self, n, what):
        return n

    def shard_tokens(self, tokens):
        return tokens

    def check_shapes(self, batch, seq, hidden, heads, ffn, vocab):
        from .shape_rules import check_model_shapes

        check_model_shapes("none", 1, False, batch, seq, hidden, heads, ffn)

    def embedding(self, vocab, hidden, init_std):
        emb = skip_init(nn.Embedding, vocab, hidden)
        with torch.no_grad():
            emb.weight.normal_(0.0, init_std)
        return emb

    def norm(self, hidden, eps):
        return nn.RMSNorm(hidden, eps=eps)

    def column_linear(self, in_features, out_features, bias, init_std, fused_parts=1):
        return plain_linear(in_features, out_features, bias, init_std)

    def row_linear(self, in_features, out_features, bias, init_std):
        return plain_linear(in_features, out_features, bias, init_std)

    def lm_head(self, hidden, vocab, init_std, tied=None):
        head = skip_init(nn.Linear, hidden, vocab, bias=False)
        if tied is not None:
            head.weight = tied.weight
        else:
            with torch.no_grad():
                head.weight.normal_(0.0, init_std)
        return head

    def loss(self, logits, targets, ignore_index=-100):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                           ignore_index=ignore_index)


def plain_linear(in_features, out_features, bias, init_std):
    """``nn.Linear`` under the init contract: global [out, in] weight ``normal_(0, init_std)``,
    zero bias, no other RNG draws (so it matches every sharded layer built from the same seed)."""
    lin = skip_init(nn.Linear, in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, init_std)
        if bias:
            lin.bias.zero_()
    return lin
