"""The depth axis of 2.5D tensor parallelism: summing the weight gradients over the d layers.

A 2.5D layer is a 2D layer built on its depth layer's grid (``mesh.grid``,
:mod:`gridshard.comm.mesh_2p5d`) plus this reduction. Why it is needed and all that is
needed: depth layer k runs the 2D layer on its own batch slice X_k (rows k·q … k·q + q − 1 of
the d·q batch blocks) with the *same* weight blocks as every other layer. The loss is a sum
over the whole batch, so for any parameter W

    ∂L/∂W = Σ_k ∂L/∂W |_(slice k)

and the 2D backward on layer k yields exactly the k-th term (its products and reductions run
inside the layer's grid). Summing the term over the ``depth`` axis (the d ranks at the same
grid position, which hold the same block of W) gives every replica the full gradient. The
activations need nothing: a token's forward and backward never leave its depth layer.

How: :func:`reduce_grads_over_depth` registers a hook on each parameter's gradient (a tensor
hook on the leaf, which autograd calls with the gradient this backward computed for it, all
uses summed, *before* it is accumulated into ``.grad``) that returns its all-reduce over
``depth``. Hence:

* gradient accumulation is exact: micro-batch m's contribution is reduced on its own and
  added to ``.grad``; the accumulated ``.grad`` is never reduced again (a post-accumulate
  hook would reduce it once per micro-batch);
* a parameter used several times in one backward (a tied head uses the embedding table)
  is reduced once, on the summed gradient; if autograd calls the hook more than once in a
  step (a reentrant recompute runs a separate backward for its region), each call carries a
  different part of the gradient and the sum is still right (the all-reduce is linear);
* each parameter is registered once: the registration adds ``"depth"`` to the parameter's
  ``shard_spec.partial_grad_axes`` (the informational mark that the layer sums that
  partial gradient itself) and refuses a parameter already marked, so the shared table of
  a tied head is never reduced twice (d× too large);
* with d = 1 nothing is registered: the layer is the 2D layer, bit for bit.

Who sums depth, in one place each: the layer-level 2.5D classes (``nn/*_2p5d.py``, on a
:class:`~gridshard.comm.mesh_2p5d.Mesh2p5D`) sum it here, per backward; a training job
(``parallel.tensor_mode: 2.5d``) does not use these hooks: ``parallelize`` builds plain 2D layers
on the depth layer's grid and the gradient reducer sums (or, ZeRO ≥ 1, reduce-scatters) over the
flattened data × context × depth group once per step (``mesh.data_context``, :mod:`gridshard.mesh`).
The two never meet: a job's layers carry no depth hook, and the ``"depth"`` mark above refuses a
second one.

Cost per backward: one all-reduce over ``depth`` per parameter tensor, payload its local
block (weight in·out/q², vector n/q²), ring wire 2(d − 1)/d of it
(:mod:`gridshard.theory.tp2p5d`). The all-reduces run on autograd's thread in the order
autograd reaches the parameters, which is the same on every rank (the same graph).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..errors import LayoutError
from ..mesh import Axis
from . import collectives as C

DEPTH = "depth"


class _DepthSum:
    """Gradient hook: this backward's gradient of a parameter → its sum over the depth axis."""

    def __init__(self, axis: Axis):
        self.axis = axis

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return C.all_reduce(grad, self.axis)


def mark_partial_over_depth(param: nn.Parameter) -> None:
    """Add ``"depth"`` to the parameter's ``shard_spec.partial_grad_axes`` (refusing a parameter
    already marked: its gradient would be summed twice)."""
    spec = getattr(param, "shard_spec", None)
    if spec is None:
        raise LayoutError(f"a 2.5D parameter of shape {tuple(param.shape)} has no shard_spec. Fix: build it with "
                          f"gridshard.nn.sharding.sharded_parameter (every 2D layer does).")
    if DEPTH in spec.partial_grad_axes:
        raise LayoutError(f"the parameter {tuple(param.shape)} already has its gradient summed over depth; a "
                          f"second hook would make it d× too large. Fix: register each parameter once (a tied "
                          f"head shares the embedding's table: do not register the head).")
    param.shard_spec = replace(spec, partial_grad_axes=spec.partial_grad_axes + (DEPTH,))


def reduce_grads_over_depth(module: nn.Module, depth: Axis) -> list:
    """Sum every parameter gradient of ``module`` over ``depth`` in each backward (module
    docstring). Returns the hook handles (empty with d = 1, where nothing is needed)."""
    if depth.size == 1:
        return []
    handles = []
    for p in module.parameters():
        if p.requires_grad:
            mark_partial_over_depth(p)
            handles.append(p.register_hook(_DepthSum(depth)))
    return handles


class _DepthSummedLoss(torch.autograd.Function):
    """Forward: ``value``, a loss already summed over the depth layers without autograd
    (L = scale·Σ_k part_k, or its NaN when nothing is valid); backward: ``g·scale`` to ``part``,
    this layer's own summand.

    ∂L/∂part_k = scale on every rank, and every rank holds the same L, so the backward is
    local: the dual of a sum over ranks (as Megatron's reduce_from_group, with the scale)."""

    @staticmethod
    def forward(ctx, part, value, scale):
        ctx.scale = scale
        return value.to(part.dtype)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


def depth_summed_loss(part: torch.Tensor, value: torch.Tensor, scale) -> torch.Tensor:
    """``value`` with the gradient ``scale`` flowing to ``part`` (see :class:`_DepthSummedLoss`)."""
    return _DepthSummedLoss.apply(part, value, scale)
