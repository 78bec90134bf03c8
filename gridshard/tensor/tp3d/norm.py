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

Communication per forward + backward, N = b·s tokens (statistics in fp32 whatever x's dtype):
RMSNorm 2 all-reduces of N/q² elements on ``output``; LayerNorm 3 (N/q², N/q², 2N/q²);
each vector one all-gather and one reduce-scatter of h/q·e on ``batch``
(:func:`gridshard.tensor.tp3d.theory.rmsnorm3d_comm`). Saved per rank: x (or x̂) [b/q², s, h/q] and r.
"""
from __future__ import annotations

from .linear import hidden_cut_3d
from ..tp2d.norm import GridNorm


class _CubeNorm(GridNorm):
    """A 3D norm: the 2D norm with vectors of the cube's layout (h/q³ per rank, gathered over
    ``mesh.batch``) and statistics over ``mesh.output`` (module docstring)."""

    hidden_cut, block = staticmethod(hidden_cut_3d), "[b/q², s, h/q]"


class RMSNorm3D(_CubeNorm):
    """RMSNorm over the hidden dim of a [b/q², s, h/q] block (weight ones, h/q³ per rank)."""


class LayerNorm3D(_CubeNorm):
    """LayerNorm over the hidden dim of a [b/q², s, h/q] block (weight ones, bias zeros, h/q³ each)."""

    has_bias = True
    rebuild_output_in_backward = None  # its output is kept, not rebuilt (selective offers RMSNorms only)
