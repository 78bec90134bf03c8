"""RMSNorm3D and LayerNorm3D on a 3D activation layout [b/q², s, h/q].

On a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation, rank (i, j, l) holds
x[batch block i·q + j, :, hidden block l]: a token's hidden vector is spread over the q ranks of
``mesh.output`` (same batch block, the q hidden blocks), so the per-token statistics are
all-reduced over ``output`` — the 2D norms' math with ``output`` in the role of the grid row,
and the 2D autograd functions themselves (:mod:`gridshard.tensor.tp2d.norm`, whose docstring has the
forward and backward formulas) run here unchanged:

    RMSNorm:   r = (Σ_output Σ_local x²/h + ε)^(−1/2),  y = x·r·w
               dx = r·(g∘w) − x·r³·Σ_output(g∘w∘x)/h,  dw = Σ_tokens g∘x·r
    LayerNorm: μ, var over the full h (two all-reduces), one all-reduce of the two backward means

The affine weight (and bias) [h] is a vector of the layout (:func:`gridshard.tensor.tp3d.linear.vector_spec_3d`):
h/q³ per rank, all-gathered over ``mesh.batch`` (the q² ranks holding hidden block l) to
[h/q]; backward reduce-scatters its gradient over the same q² ranks, which sums the q² batch
blocks' contributions (every token of the micro-batch once).

Communication per forward + backward, N = b·s tokens (stats in fp32 for RMSNorm, in x's dtype for
LayerNorm): RMSNorm 2 all-reduces of N/q² elements on ``output``; LayerNorm 3 (N/q², N/q², 2N/q²);
each vector one all-gather and one reduce-scatter of h/q·e on ``batch``
(:func:`gridshard.tensor.tp3d.theory.rmsnorm3d_comm`). Saved per rank: x (or x̂) [b/q², s, h/q] and r.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...errors import ShapeError, check_divisible
from .linear import gather_vector_3d, sharded_parameter_3d, vector_spec_3d
from ..tp2d.norm import _LayerNorm2DFn, _RMSNorm2DFn
from ...nn.rebuild import RebuildRegion


class _Norm3DBase(nn.Module):
    def __init__(self, hidden: int, mesh, eps: float, vector_cache=None):
        super().__init__()
        q = mesh.q
        check_divisible(hidden, q ** 3, "hidden (3D norm weights are split into q³ blocks)", "q³",
                        f"use hidden a multiple of {q ** 3}")
        self.mesh, self.hidden, self.eps = mesh, hidden, eps
        self.hidden_local = hidden // q
        self.vector_cache = vector_cache

    def _vector(self, init, dtype, device):
        return sharded_parameter_3d(vector_spec_3d(self.hidden, self.mesh), self.mesh, init, dtype, device)

    def _check(self, x):
        if x.shape[-1] != self.hidden_local:
            raise ShapeError(f"{type(self).__name__}({self.hidden}) got a local input with last dim {x.shape[-1]}: "
                             f"on a q={self.mesh.q} cube each rank holds hidden/q = {self.hidden_local}. "
                             f"Fix: pass this rank's [b/q², s, h/q] block.")

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.mesh.q}, eps={self.eps}"


class RMSNorm3D(_Norm3DBase):
    """RMSNorm over the hidden dim of a [b/q², s, h/q] block (weight ones, h/q³ per rank)."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, dtype: torch.dtype = torch.float32, device=None,
                 vector_cache=None):
        super().__init__(hidden, mesh, eps, vector_cache)
        self.weight = self._vector(nn.init.ones_, dtype, device)

    #: the decoder layer's :class:`gridshard.nn.rebuild.RebuildRegion` the output is offered to
    #: (``train.recompute: selective``); None unless :meth:`rebuild_output_in_backward` sets it
    rebuild: Optional[RebuildRegion] = None

    def rebuild_output_in_backward(self, region: RebuildRegion) -> None:
        """Offer y to ``region`` with its recipe (x, r, w), as RMSNorm2D: the consumer (the next
        Linear3D's product, which saves its input block) keeps that, not y."""
        self.rebuild = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        w = gather_vector_3d(self.weight, self.mesh, self.vector_cache)
        region = self.rebuild if self.rebuild is not None and self.rebuild.accepting() else None
        return _RMSNorm2DFn.apply(x, w, self.mesh.output, self.hidden, self.eps, region)


class LayerNorm3D(_Norm3DBase):
    """LayerNorm over the hidden dim of a [b/q², s, h/q] block (weight ones, bias zeros, h/q³ each)."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, dtype: torch.dtype = torch.float32, device=None,
                 vector_cache=None):
        super().__init__(hidden, mesh, eps, vector_cache)
        self.weight = self._vector(nn.init.ones_, dtype, device)
        self.bias = self._vector(nn.init.zeros_, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        w = gather_vector_3d(self.weight, self.mesh, self.vector_cache)
        b = gather_vector_3d(self.bias, self.mesh, self.vector_cache)
        return _LayerNorm2DFn.apply(x, w, b, self.mesh.output, self.hidden, self.eps)
