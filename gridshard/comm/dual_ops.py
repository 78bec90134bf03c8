"""Autograd functions whose backward is the dual of their forward (Megatron's trick).

A tensor-parallel layer puts all its communication in these six functions; the
autograd engine then runs the dual collective in backward automatically.

=========================  ======================  ======================
function                   forward                 backward
=========================  ======================  ======================
``copy_to_group``          identity                all-reduce
``reduce_from_group``      all-reduce              identity
``scatter_to_group``       split along ``dim``     all-gather along ``dim``
``gather_from_group``      all-gather ``dim``      split along ``dim``
``gather_sequence``        all-gather ``dim``      reduce-scatter ``dim``
``reduce_scatter_sequence`` reduce-scatter ``dim``  all-gather ``dim``
``reduce_scatter_sequence_bias`` RS ``dim`` + bias  all-gather ``dim``; bias
                                                   grad from the gathered g
=========================  ======================  ======================

Why each pair is right, for a group of n ranks that all compute the same loss L:

* ``copy_to_group``: y = x is used by every rank with a different weight shard,
  so ∂L/∂x = Σ_ranks ∂L/∂y_rank → all-reduce.
* ``reduce_from_group``: y = Σ_r x_r and every rank holds the same y and the same
  ∂L/∂y, which is exactly ∂L/∂x_r → identity.
* ``scatter_to_group``/``gather_from_group``: a slice and a concatenation are each
  other's adjoint when the gathered tensor is replicated (identical ∂L/∂y on every
  rank), so the gradient of a gather is "take my slice".
* ``gather_sequence``/``reduce_scatter_sequence`` (sequence parallelism): the
  gathered full-sequence activation feeds a column-parallel matmul whose
  gradient on every rank is a *partial* sum; the adjoint of all-gather over
  partial gradients is reduce-scatter, and vice versa.

The group is given as a :class:`gridshard.mesh.Axis`; on an axis of size 1 every
function is the identity.

Sequence-first storage. Sequence-parallel activations keep the model's logical shape
[b, s, h] (the block [b, s/n, h]) but are *stored* sequence-first, i.e. they are
``transpose(0, 1)`` views of contiguous [s, b, h] tensors, as Megatron's sequence-first
activations are, without the model code having to know. Then the sequence dim is the
outermost in memory and ``gather_sequence`` / ``reduce_scatter_sequence`` (dim 1) move the
blocks straight into / out of one buffer, forward and backward, with no reorder copy
(:mod:`gridshard.comm.collectives`), and hand on the same layout. The 1D layers produce
and consume it: the SP embedding looks up the transposed tokens, the row layer computes
its partial product sequence-first, the column layer multiplies the [s, b, h] view
(:func:`gridshard.tensor.tp1d.linear.column_product`). Element-wise ops, RMSNorm and the
residual adds keep a dense layout, so the residual stream stays sequence-first. An input
stored batch-first is still correct: the collectives then reorder it with one copy.
"""
from __future__ import annotations

import torch

from ..mesh import Axis
from . import collectives as C


def _split(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    if axis.size == 1:
        return x
    if x.shape[dim] % axis.size:
        raise ValueError(f"cannot split size {x.shape[dim]} of dim {dim} over {axis.size} ranks of axis '{axis.name}'")
    return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return C.all_reduce(g, ctx.axis), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return C.all_reduce(x, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _dual(name: str, forward: str, backward: str):
    """The autograd Function ``name``: y = forward(x, axis, dim), ∂L/∂x = backward(∂L/∂y, axis, dim),
    each ``"split"`` (:func:`_split`) or a collective of :mod:`gridshard.comm.collectives`, looked up
    at call time."""

    def op(which: str):
        return _split if which == "split" else getattr(C, which)

    def fwd(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return op(forward)(x, axis, dim)

    def bwd(ctx, g):
        return op(backward)(g, ctx.axis, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_ScatterToGroup = _dual("_ScatterToGroup", "split", "all_gather")
_GatherFromGroup = _dual("_GatherFromGroup", "all_gather", "split")
_GatherSequence = _dual("_GatherSequence", "all_gather", "reduce_scatter")
_ReduceScatterSequence = _dual("_ReduceScatterSequence", "reduce_scatter", "all_gather")


class _ReduceScatterSequenceBias(torch.autograd.Function):
    """y = reduce_scatter(p, dim) + b with a replicated bias b [h]. Backward: the all-gather
    of g that ∂L/∂p needs anyway gives every rank the whole [.., s, .., h] gradient, so
    ∂L/∂b = Σ_tokens g_full is complete, and the same, on every rank: no all-reduce of the
    bias gradient (which adding b to the block through ``copy_to_group`` would need)."""

    @staticmethod
    def forward(ctx, partial, bias, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        block = C.reduce_scatter(partial, axis, dim)
        return block + bias.to(block.dtype)          # autocast: the block's (compute) dtype, as F.linear's

    @staticmethod
    def backward(ctx, g):
        g_full = C.all_gather(g, ctx.axis, ctx.dim)
        db = g_full.sum(dim=tuple(range(g_full.dim() - 1))) if ctx.needs_input_grad[1] else None
        return g_full, db, None, None


class _SumOverReplicas(torch.autograd.Function):
    """Forward identity on a parameter block that groups of ``r`` consecutive ranks hold in
    common (block k = rank // r); backward sums the gradient over each group. The T/r blocks
    are laid into one zero buffer at their slots and all-reduced over the whole axis (one
    all-reduce of T/r · block elements: no sub-groups to create, so nothing can hang)."""

    @staticmethod
    def forward(ctx, w, axis, r):
        ctx.axis, ctx.r = axis, r
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        axis, r = ctx.axis, ctx.r
        buf = g.new_zeros((axis.size // r, *g.shape))
        buf[axis.rank // r] = g
        return C.all_reduce(buf, axis, inplace=True)[axis.rank // r], None, None


def reduce_scatter_sequence_bias(x: torch.Tensor, bias: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel exit with a replicated bias [h] added to the block: forward
    reduce-scatter + bias, backward all-gather, and the bias gradient summed over the
    gathered gradient (complete on every rank, no collective of its own)."""
    if axis.size == 1:
        return x + bias.to(x.dtype)
    return _ReduceScatterSequenceBias.apply(x, bias, axis, dim)


def sum_over_replicas(w: torch.Tensor, axis: Axis, r: int) -> torch.Tensor:
    """Use a block shared by groups of ``r`` ranks: identity forward, gradient summed over the
    group backward (grouped-query attention with T > kv heads: T/kv ranks share a kv head)."""
    if axis.size == 1 or r == 1:
        return w
    return _SumOverReplicas.apply(w, axis, r)


def copy_to_group(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Forward identity, backward all-reduce over ``axis``."""
    return x if axis.size == 1 else _CopyToGroup.apply(x, axis)


def reduce_from_group(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Forward all-reduce over ``axis``, backward identity."""
    return x if axis.size == 1 else _ReduceFromGroup.apply(x, axis)


def scatter_to_group(x: torch.Tensor, axis: Axis, dim: int = -1) -> torch.Tensor:
    """Forward keep my 1/n slice along ``dim``, backward all-gather along ``dim``."""
    return x if axis.size == 1 else _ScatterToGroup.apply(x, axis, dim)


def gather_from_group(x: torch.Tensor, axis: Axis, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along ``dim``, backward keep my slice."""
    return x if axis.size == 1 else _GatherFromGroup.apply(x, axis, dim)


def gather_sequence(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism entry: forward all-gather along ``dim``, backward reduce-scatter."""
    return x if axis.size == 1 else _GatherSequence.apply(x, axis, dim)


def reduce_scatter_sequence(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism exit: forward reduce-scatter along ``dim``, backward all-gather."""
    return x if axis.size == 1 else _ReduceScatterSequence.apply(x, axis, dim)
