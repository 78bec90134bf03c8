"""LayerNorm (with bias) for the none / 1D layouts, also inside a sequence-parallel region.

    y = (x − mean(x)) / sqrt(var(x) + eps) · w + b,     x [.., h], w, b [h] (ones, zeros)

Both vectors are replicated on every tensor rank. Without sequence parallelism every tensor
rank sees the same whole activation [b, s, h], so every rank computes the same complete
∂L/∂w and ∂L/∂b: nothing is communicated (the layer is ``F.layer_norm``).

With sequence parallelism rank t holds the sequence block x_t [b, s/T, h]; its local
gradients are partial sums over that block,

    ∂L/∂w = Σ_t Σ_{tokens of block t} g ∘ x̂,     ∂L/∂b = Σ_t Σ_{tokens of block t} g,

so the layer uses both vectors through ``copy_to_group`` (forward identity, backward
all-reduce of h elements each) and their ``.grad`` is complete and identical on every rank
after backward (the spec's ``partial_grad_axes=("tensor",)`` records it, as for
:class:`gridshard.nn.norm.RMSNorm`: callers must not reduce again). Communication per
forward+backward under SP: two all-reduces of h·bytes. A sequence-first input (SP storage)
is normalised as its contiguous [s, b, h] view, so the output keeps that layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.dual_ops import copy_to_group
from ...errors import LayoutError
from ...nn.sharding import ShardSpec, set_spec, sequence_parallel_on


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, weight ones and bias zeros [hidden], replicated (module
    docstring). ``mesh`` is needed only with ``sequence_parallel=True``."""

    def __init__(self, hidden: int, eps: float = 1e-5, mesh=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and mesh is None:
            raise LayoutError("LayerNorm(sequence_parallel=True) needs the mesh: its weight and bias gradients are "
                              "partial sums over the tensor group. Fix: pass mesh=<ParallelMesh>.")
        self.hidden, self.eps = hidden, eps
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        self.axis = mesh.tensor if mesh is not None else None
        spec = ShardSpec((hidden,), (), partial_grad_axes=("tensor",) if self.sequence_parallel else ())
        self.weight = set_spec(nn.Parameter(torch.ones(hidden, dtype=dtype, device=device)), spec)
        self.bias = set_spec(nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)), spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w, b = copy_to_group(w, self.axis), copy_to_group(b, self.axis)
        if x.dim() >= 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous():
            return F.layer_norm(x.transpose(0, 1), (self.hidden,), w, b, self.eps).transpose(0, 1)
        return F.layer_norm(x, (self.hidden,), w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
