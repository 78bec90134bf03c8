"""RMSNorm2D and LayerNorm2D on the 2D activation layout [b/q, s, h/q].

Rank (i, j) holds x[batch block i, :, hidden block j]. A token's hidden vector is
spread over the q ranks of grid row i, so the statistics are all-reduced along
``mesh.row`` (one [b/q, s, 1] tensor per reduction). The affine weight (and bias)
[h] is stored as h/q² shards like a Linear2D bias (sub-block i of hidden block j)
and all-gathered along ``mesh.col`` to block j [h/q] (backward: reduce-scatter of
the weight gradient, summing the q batch blocks); the gathered block is kept until the
optimizer changes the shard (:func:`gridshard.comm.grid_ops.gather_vector`), so the
all-gather runs once per step, not once per forward.

RMSNorm (r = (Σ_global x²/h + ε)^(−1/2), y = x·r·w):

    dx = r·(g∘w) − x·r³·Σ_global(g∘w∘x)/h,   dw = Σ_tokens g∘x·r

LayerNorm (μ = Σx/h, x̂ = (x − μ)·r, r = (Σ(x − μ)²/h + ε)^(−1/2), y = x̂∘w + b):

    dx = r·(g∘w − mean(g∘w) − x̂·mean(g∘w∘x̂)),   dw = Σ g∘x̂,   db = Σ g

where Σ_global / mean run over the full hidden dim (all-reduce along the row).
Communication per forward+backward: RMSNorm 2 row all-reduces of [b/q, s, 1];
LayerNorm 3 (two for μ and var, one for the two backward means stacked), all in fp32 whatever
x's dtype (the statistics are computed in fp32, as autocast computes ``layer_norm``). Saved for
backward per rank: x (or x̂) [b/q, s, h/q] in x's dtype and r [b/q, s, 1] in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...comm import collectives as C
from ...errors import ShapeError, check_divisible
from ...comm.grid_ops import gather_vector
from .linear import hidden_cut_2d
from ...nn.rebuild import RebuildRegion, offer_to


class _RMSNorm2DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, row, hidden, eps, region=None):
        # in fp32 (a no-op for fp32 x); a bf16/fp16 x (autocast) is kept in its dtype, y returned in it
        xf = x.float()
        ss = C.all_reduce(xf.pow(2).sum(-1, keepdim=True), row, inplace=True)
        r = torch.rsqrt(ss / hidden + eps)
        ctx.save_for_backward(x, r, w)
        ctx.row, ctx.hidden = row, hidden
        return offer_to(region, _scale(x, r, w), _scale, x, r, w)

    @staticmethod
    def backward(ctx, g):
        x, r, w = ctx.saved_tensors
        xf = x.float()
        gw = g.float() * w
        dot = C.all_reduce((gw * xf).sum(-1, keepdim=True), ctx.row, inplace=True)
        dx = r * gw - xf * (r.pow(3) * dot / ctx.hidden)
        dw = (g.float() * xf * r).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None, None, None, None


def _scale(x, r, w):
    """y = (x_f·r·w) in x's dtype: the output of :class:`_RMSNorm2DFn` and its rebuild recipe
    (x, r and the gathered w are kept by its backward; no collective: r is the reduced one)."""
    return (x.float() * r * w).to(x.dtype)


class _LayerNorm2DFn(torch.autograd.Function):
    """In fp32 whatever x's dtype, as autocast runs ``layer_norm``: a bf16/fp16 x gets fp32 μ, r and
    all-reduced sums (a bf16 Σx over h/q values of mean 100 is off by units); x̂ is kept in x's
    dtype, as x would be; y comes back in the promotion of x's and w's dtypes (x̂·w + b's), dx in
    x's dtype (fp32: every cast a no-op)."""

    @staticmethod
    def forward(ctx, x, w, b, row, hidden, eps):
        xf = x.float()
        mu = C.all_reduce(xf.sum(-1, keepdim=True), row, inplace=True) / hidden
        xc = xf - mu
        var = C.all_reduce(xc.pow(2).sum(-1, keepdim=True), row, inplace=True) / hidden
        r = torch.rsqrt(var + eps)
        xhat = xc * r
        ctx.save_for_backward(xhat.to(x.dtype), r, w)
        ctx.row, ctx.hidden, ctx.param_dtype = row, hidden, b.dtype
        return (xhat * w + b).to(torch.promote_types(x.dtype, w.dtype))

    @staticmethod
    def backward(ctx, g):
        xhat_saved, r, w = ctx.saved_tensors
        xhat, gf = xhat_saved.float(), g.float()
        gw = gf * w
        sums = C.all_reduce(torch.cat([gw.sum(-1, keepdim=True), (gw * xhat).sum(-1, keepdim=True)], -1), ctx.row,
                            inplace=True)
        m1, m2 = (sums / ctx.hidden).split(1, -1)
        dx = r * (gw - m1 - xhat * m2)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return (dx.to(xhat_saved.dtype), flat(gf * xhat).sum(0).to(ctx.param_dtype),
                flat(gf).sum(0).to(ctx.param_dtype), None, None, None)


class GridNorm(nn.Module):
    """The 2D norms and, with ``hidden_cut`` (and the message's ``block``) overridden, the 3D ones:
    vectors of [hidden] cut as the mode's :class:`gridshard.tensor.hidden_cut.HiddenCut` says (q² or q³
    blocks), gathered over its ``gather`` axis (``vector_cache``: the model's
    :class:`gridshard.comm.grid_ops.GatheredVectors`, or ``None`` to gather on every forward), token
    statistics all-reduced over its ``reduce`` axis (2D: the grid row). ``has_bias``: LayerNorm
    (weight ones, bias zeros), else RMSNorm (weight ones)."""

    hidden_cut, block, has_bias = staticmethod(hidden_cut_2d), "[b/q, s, h/q]", False

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, dtype: torch.dtype = torch.float32, device=None,
                 vector_cache=None):
        super().__init__()
        self.cut = cut = self.hidden_cut(mesh)
        check_divisible(hidden, cut.blocks, f"hidden (norm weights are split into {cut.power} blocks)", cut.power,
                        f"use hidden a multiple of {cut.blocks}")
        self.mesh, self.hidden, self.eps = mesh, hidden, eps
        self.hidden_local = hidden // mesh.q
        self.vector_cache = vector_cache
        self.weight = cut.parameter(cut.spec((hidden,), 0), nn.init.ones_, dtype, device)
        if self.has_bias:
            self.bias = cut.parameter(cut.spec((hidden,), 0), nn.init.zeros_, dtype, device)

    def gathered(self, v: torch.Tensor) -> torch.Tensor:
        return gather_vector(v, self.cut.gather, self.vector_cache)

    #: the decoder layer's :class:`gridshard.nn.rebuild.RebuildRegion` the output is offered to
    #: (``train.recompute: selective``); None unless :meth:`rebuild_output_in_backward` sets it
    rebuild: Optional[RebuildRegion] = None

    def rebuild_output_in_backward(self, region: RebuildRegion) -> None:
        """Offer an RMSNorm's y to ``region`` with its recipe (x, r, w): a consumer (SUMMA, or the
        next Linear3D's product, which saves its input block) keeps that, not y."""
        self.rebuild = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_local:
            raise ShapeError(f"{type(self).__name__}({self.hidden}) got a local input with last dim {x.shape[-1]}: "
                             f"on a q={self.mesh.q} {self.cut.shape} each rank holds hidden/q = "
                             f"{self.hidden_local}. Fix: pass this rank's {self.block} block.")
        w = self.gathered(self.weight)
        if self.has_bias:
            return _LayerNorm2DFn.apply(x, w, self.gathered(self.bias), self.cut.reduce, self.hidden, self.eps)
        region = self.rebuild if self.rebuild is not None and self.rebuild.accepting() else None
        return _RMSNorm2DFn.apply(x, w, self.cut.reduce, self.hidden, self.eps, region)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.mesh.q}, eps={self.eps}"


class RMSNorm2D(GridNorm):
    """RMSNorm over the hidden dim of a [b/q, s, h/q] block (weight ones, h/q² per rank)."""


class LayerNorm2D(GridNorm):
    """LayerNorm over the hidden dim of a [b/q, s, h/q] block (weight ones, bias zeros, h/q² each)."""

    has_bias = True
    rebuild_output_in_backward = None  # its output is kept, not rebuilt (selective offers RMSNorms only)
