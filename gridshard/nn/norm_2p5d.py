"""RMSNorm2p5D and LayerNorm2p5D: the 2D norms on my depth layer's grid + the depth sum of
their weight (and bias) gradients (:mod:`gridshard.comm.depth_ops`).

Rank (k, i, j) holds x[batch block k·q + i, :, hidden block j] = [b/(d·q), s, h/q]. A token's
hidden vector lies in one grid row of one depth layer, so the statistics are the 2D ones
(all-reduced along ``row``, :mod:`gridshard.nn.norm_2d`); the affine vectors are h/q² shards
as in 2D, replicated over depth, and their gradient Σ_tokens (g∘x̂ …) over the layer's tokens
is a partial sum of the batch's: all-reduced over ``depth`` once per backward.

Communication per forward + backward: 2D's on N/d tokens
(:func:`gridshard.theory.tp2d.rmsnorm2d_comm`) + one depth all-reduce of h/q²·e per vector
(:func:`gridshard.theory.tp2p5d.rmsnorm2p5d_comm`). Saved per rank: x (x̂) [N/(d·q), h/q] and r.
"""
from __future__ import annotations

from ..comm.depth_ops import reduce_grads_over_depth
from .norm_2d import LayerNorm2D, RMSNorm2D


class RMSNorm2p5D(RMSNorm2D):
    """RMSNorm over the hidden dim of a [b/(d·q), s, h/q] block; ``mesh`` a ``Mesh2p5D``."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, **kwargs):
        super().__init__(hidden, mesh.grid, eps, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)


class LayerNorm2p5D(LayerNorm2D):
    """LayerNorm over the hidden dim of a [b/(d·q), s, h/q] block; ``mesh`` a ``Mesh2p5D``."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, **kwargs):
        super().__init__(hidden, mesh.grid, eps, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)
