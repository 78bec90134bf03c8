"""Summa2DStyle: the reference Transformer laid out on a q×q grid (T = q²) by SUMMA.

``gridshard.models.Transformer(cfg, Summa2DStyle(mesh))`` is the 2D transformer.

Layouts at rank (i, j) (i = ``mesh.grid_row``, j = ``mesh.grid_col``):

=================  ==================================  ===============================
tensor             global                               local block
=================  ==================================  ===============================
tokens / targets   [b, s]                               [b/q, s]        batch block i
residual stream    [b, s, h]                            [b/q, s, h/q]   (i, j)
split layout       [b, s, n] (n = heads·d or ffn)       [b/q, s, n/q]   heads/neurons j
logits             [b, s, V_pad]                        [b/q, s, V_pad/q]  vocab block j
=================  ==================================  ===============================

* ``column_linear`` / ``row_linear``: :class:`Linear2D` (SUMMA); a fused q|k|v or
  gate|up output keeps whole heads/neurons of block j on rank (i, j), so attention
  and SwiGLU run locally on heads j·H/q … (j+1)·H/q of batch block i.
* ``norm``: :class:`RMSNorm2D` (statistics all-reduced along the row).
* ``embedding``: :class:`VocabParallelEmbedding2D`; ``lm_head``: a vocab-parallel
  Linear2D, or with ``tied`` a SUMMA A·Bᵀ on the embedding's table.
* ``loss``: :func:`cross_entropy_2d`, the global mean, the same on every rank.

Size rules (``check_shapes``; layers check their own sizes when built): batch, heads,
ffn_hidden divisible by q; hidden divisible by q² (the norm weights are stored in q²
blocks, like Linear2D biases); the vocabulary is padded to a multiple of q.
"""
from __future__ import annotations

import torch

from ..errors import LayoutError, check_divisible
from .classifier_2d import TiedVocabHead2D, VocabParallelClassifier2D
from .cross_entropy_2d import cross_entropy_2d
from .embedding_2d import VocabParallelEmbedding2D
from .linear_2d import Linear2D
from .norm_2d import RMSNorm2D
from .style import TensorParallelStyle


class Summa2DStyle(TensorParallelStyle):
    """2D tensor parallelism on ``mesh`` (built with ``tensor=q*q, tensor_mode='2d'``)."""

    mode = "2d"

    def __init__(self, mesh, sequence_parallel: bool = False):
        if getattr(mesh, "tensor_mode", None) != "2d":
            raise LayoutError(f"Summa2DStyle needs a 2D mesh, got tensor_mode={getattr(mesh, 'tensor_mode', None)!r}. "
                              f"Fix: build_mesh(..., tensor=q*q, tensor_mode='2d').")
        if sequence_parallel:
            raise LayoutError("sequence_parallel=True applies to tensor_mode='1d' only; 2D already splits "
                              "activations over the q×q grid. Fix: set sequence_parallel=false.")
        super().__init__(mesh, sequence_parallel=False)
        self.q = mesh.q
        self.vocab_size = None

    # ---- sizes and data layout -------------------------------------------------
    def split_size(self, n: int, what: str) -> int:
        check_divisible(n, self.q, what, "grid side q", f"use {what} a multiple of q={self.q}")
        return n // self.q

    def shard_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        check_divisible(tokens.shape[0], self.q, "batch", "grid side q",
                        f"use a batch that is a multiple of q={self.q}")
        return tokens.chunk(self.q, 0)[self.mesh.grid_row].contiguous()

    def check_shapes(self, batch: int, seq: int, hidden: int, heads: int, ffn: int, vocab: int) -> None:
        """The 2D rules of :mod:`gridshard.nn.shape_rules` (shared with the config validator):
        batch, heads, ffn_hidden % q; hidden % q²; whole even-sized heads. Vocab is padded."""
        from .shape_rules import check_model_shapes

        check_model_shapes("2d", self.q * self.q, False, batch, seq, hidden, heads, ffn)

    # ---- layers --------------------------------------------------------------------
    def embedding(self, vocab, hidden, init_std):
        return VocabParallelEmbedding2D(vocab, hidden, self.mesh, init_std)

    def norm(self, hidden, eps):
        return RMSNorm2D(hidden, self.mesh, eps)

    def column_linear(self, in_features, out_features, bias, init_std, fused_parts=1):
        return Linear2D(in_features, out_features, self.mesh, bias=bias, init_std=init_std, fused_parts=fused_parts)

    def row_linear(self, in_features, out_features, bias, init_std):
        return Linear2D(in_features, out_features, self.mesh, bias=bias, init_std=init_std)

    def lm_head(self, hidden, vocab, init_std, tied=None):
        self.vocab_size = vocab
        if tied is not None:
            return TiedVocabHead2D(tied)
        return VocabParallelClassifier2D(hidden, vocab, self.mesh, init_std)

    def loss(self, logits, targets, ignore_index=-100):
        if self.vocab_size is None:
            raise LayoutError("Summa2DStyle.loss needs the vocabulary size: build the model's lm_head with this "
                              "style first (it records vocab_size to mask the padding columns).")
        return cross_entropy_2d(logits, targets, self.mesh, self.vocab_size, ignore_index)
