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

import torch.nn.functional as F

from ...nn.norm import ReplicatedNorm


class LayerNorm(ReplicatedNorm):
    """LayerNorm over the last dim, weight ones and bias zeros [hidden], replicated (module
    docstring). ``mesh`` is needed only with ``sequence_parallel=True``."""

    has_bias = True

    def forward(self, x):
        return self.normalise(lambda x, w, b: F.layer_norm(x, (self.hidden,), w, b, self.eps), x,
                              self.weight, self.bias)
