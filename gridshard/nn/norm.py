"""RMSNorm that also works inside a sequence-parallel region.

    y = x / sqrt(mean(x², -1) + eps) · w,     x [.., h], w [h] (ones at init)

The weight is replicated on every tensor rank. Without sequence parallelism every
tensor rank sees the same full activation [b, s, h], so every rank computes the
same, complete ∂L/∂w and nothing needs to be communicated.

With sequence parallelism rank t holds only the sequence block t, x_t [b, s/T, h],
and its local weight gradient is the partial sum over that block:

    ∂L/∂w = Σ_t Σ_{tokens of block t} g ⊙ x̂      (x̂ = normalised x)

so the T partial gradients must be summed over the tensor group. The layer does
it itself, exactly once, by using the weight through ``copy_to_group(w, tensor)``
(forward identity, backward all-reduce of h elements). After ``backward`` the
``.grad`` of the weight is therefore already complete and identical on all tensor
ranks. The weight's :class:`ShardSpec` carries ``partial_grad_axes=("tensor",)`` to
record that its gradient is born partial over ``tensor`` — reduced inside the layer,
so callers must NOT all-reduce it again over that axis.

Communication per forward+backward under SP: one all-reduce of h·bytes (backward).
A sequence-first input (how SP activations are stored, :mod:`gridshard.comm.dual_ops`) is
normalised as its contiguous [s, b, h] view, so the output keeps that layout (``F.rms_norm``
would return a batch-first copy).

Precision (:func:`rms_norm`): an fp32 input runs ``F.rms_norm`` (as before, bit for bit; on CPU
it keeps x, x̂ = x·rstd and rstd for backward). A bf16/fp16 input (the residual stream under
autocast, :mod:`gridshard.models.llama`) is normalised in fp32 and returned in its own dtype by
:class:`_LowPrecisionRMSNorm`, which keeps only x (its dtype) and rstd (fp32, one per token) and
rebuilds x̂ in backward, as a fused RMSNorm kernel does::

    rstd = (mean(x², -1) + ε)^(-1/2),  y = (x·rstd·w) in x's dtype
    dx = rstd·(g∘w − x̂·mean(g∘w∘x̂, -1)),  dw = Σ_tokens g∘x̂      (all in fp32)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.dual_ops import copy_to_group
from ..errors import LayoutError
from .rebuild import RebuildRegion, offer_to
from .sharding import ShardSpec, set_spec, sequence_parallel_on


class _LowPrecisionRMSNorm(torch.autograd.Function):
    """RMSNorm of a bf16/fp16 x computed in fp32, returned in x's dtype (module docstring):
    saves x and rstd [.., 1] (fp32), not x̂."""

    @staticmethod
    def forward(ctx, x, w, eps, region=None):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, w)
        return offer_to(region, _scale_low(x, rstd, w), _scale_low, x, rstd, w)

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = g.float() * w.float()
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None, None


def _scale_low(x, rstd, w):
    """y = (x_f·rstd·w_f) in x's dtype: the bf16/fp16 norm's output, also its rebuild recipe."""
    return (x.float() * rstd * w.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             region: Optional[RebuildRegion] = None) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 arithmetic, returned in x's dtype (module docstring,
    "Precision"): ``F.rms_norm`` for fp32 x, :class:`_LowPrecisionRMSNorm` for bf16/fp16 x.

    ``region`` (:mod:`gridshard.nn.rebuild`, selective recompute) accepting offers: y is offered
    with its recipe — bf16/fp16 (x, rstd, w), kept by the norm's backward; fp32 y = x̂·w, computed
    as ``F.rms_norm``'s CPU decomposition (pow, mean, add, rsqrt, mul, mul: the same values and
    gradients bit for bit, and the same kept x, rstd, x̂) so that x̂ is at hand."""
    if x.dtype in (torch.bfloat16, torch.float16):
        offer = region if region is not None and region.accepting() else None
        return _LowPrecisionRMSNorm.apply(x, weight, eps, offer)
    if region is not None and region.accepting():
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return offer_to(region, xhat * weight, torch.mul, xhat, weight)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class ReplicatedNorm(nn.Module):
    """The none / 1D norms: vectors of [hidden] replicated on every tensor rank (ones, and zeros for
    a bias), used through ``copy_to_group`` under sequence parallelism so that their gradients are
    summed over the tensor group inside the layer (module docstring); ``mesh`` is needed only
    then. A sequence-first input (SP storage) is normalised as its contiguous [s, b, h] view."""

    #: whether the norm has a bias vector beside its weight
    has_bias = False

    def __init__(self, hidden: int, eps: float = 1e-5, mesh=None, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and mesh is None:
            raise LayoutError(f"{type(self).__name__}(sequence_parallel=True) needs the mesh: its vectors' "
                              "gradients are partial sums over the tensor group. Fix: pass mesh=<ParallelMesh>.")
        self.hidden, self.eps = hidden, eps
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        self.axis = mesh.tensor if mesh is not None else None
        spec = ShardSpec((hidden,), (), partial_grad_axes=("tensor",) if self.sequence_parallel else ())
        self.weight = set_spec(nn.Parameter(torch.ones(hidden, dtype=dtype, device=device)), spec)
        if self.has_bias:
            self.bias = set_spec(nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)), spec)

    def normalise(self, fn, x: torch.Tensor, *vectors) -> torch.Tensor:
        """``fn(x, *vectors)`` with each vector through ``copy_to_group`` under SP, on x's
        contiguous [s, b, h] view when x is stored sequence-first (the output keeps that layout)."""
        if self.sequence_parallel:
            vectors = tuple(copy_to_group(v, self.axis) for v in vectors)
        if x.dim() >= 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous():
            return fn(x.transpose(0, 1), *vectors).transpose(0, 1)
        return fn(x, *vectors)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm(ReplicatedNorm):
    """RMSNorm over the last dim with a replicated ``weight`` [hidden] (ones).

    ``mesh`` is only needed with ``sequence_parallel=True`` (the weight gradient is
    then all-reduced over ``mesh.tensor``); otherwise this is a plain RMSNorm with
    the same numerics as :class:`torch.nn.RMSNorm`. Whether sequence parallelism is in
    effect is the job layout's rule
    (:meth:`gridshard.job_layout.TensorMode.sequence_parallel_in_effect`: off at T = 1).
    """

    #: the decoder layer's :class:`gridshard.nn.rebuild.RebuildRegion` this norm offers its output
    #: to (``train.recompute: selective``); None unless :meth:`rebuild_output_in_backward` sets it
    rebuild: Optional[RebuildRegion] = None

    def rebuild_output_in_backward(self, region: RebuildRegion) -> None:
        """Offer y to ``region``: a consumer keeps its recipe, not y (:func:`rms_norm`)."""
        self.rebuild = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(lambda x, w: rms_norm(x, w, self.eps, self.rebuild), x, self.weight)
