"""A column layer's input gradient reduced while its weight gradient is computed.

A column-parallel product y = x·Wᵀ on rank t of T needs, in backward, the input gradient
∂L/∂x = Σ_t g_t·W_t (an all-reduce over the tensor group, or under sequence parallelism a
reduce-scatter to the sequence blocks) and the weight gradient ∂L/∂W_t = g_tᵀ·x (local). As
two autograd nodes (``copy_to_group`` / ``gather_sequence`` before the product) the collective
starts only after the product's backward has computed both. Here the product's backward
computes ∂L/∂x first, *starts* the collective on it asynchronously, computes ∂L/∂W_t while the
collective runs (NCCL on its own stream; gloo on its own thread), and the entry node's backward
waits for it: the same result as the two-node order, with the weight-gradient GEMM hiding the
collective (Megatron-LM's asynchronous tensor-parallel all-reduce, generalised to the
reduce-scatter of sequence parallelism).

The pieces meet through an :class:`InputGradHandoff`, made per forward by :func:`column_input`
and handed to the product (:func:`gridshard.nn.linear_1d.column_product`). Exactness does not
depend on autograd's routing: the entry uses the early result only if the gradient it
receives *is* the tensor the product launched the collective on (the product was the input's
only consumer); otherwise it reduces the gradient it received, as the two-node order does.
The early all-reduce runs on a copy (the tensor handed to autograd is never written while in
flight); the reduce-scatter is out of place anyway. Ledger entries are the same calls and bytes
as without overlap.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..mesh import Axis
from . import collectives as C


class InputGradHandoff:
    """The early input-gradient collective of one forward, from the product's backward
    (:meth:`launch`) to the entry's backward (:meth:`take`)."""

    def __init__(self, axis: Axis, sequence_parallel: bool, dim: int):
        self.axis, self.sequence_parallel, self.dim = axis, sequence_parallel, dim
        self._pending = self._source = None

    def launch(self, dx: torch.Tensor) -> None:
        """Start the collective on ``dx`` (the full input gradient of this rank's product)."""
        if self._pending is not None:           # a second product on the same handoff: leave it to the entry
            return
        self._source = dx
        if self.sequence_parallel:
            self._pending = C.reduce_scatter(dx, self.axis, self.dim, async_op=True)
        else:
            self._pending = C.all_reduce(dx, self.axis, async_op=True)        # on a copy of dx

    def take(self, g: torch.Tensor) -> Optional[torch.Tensor]:
        """The reduced gradient if ``g`` is the launched tensor itself; else None (after
        completing the launched collective, which every member started alike)."""
        if self._pending is None:
            return None
        pending, source = self._pending, self._source
        self._pending = self._source = None
        result = pending.wait()
        same = (g.data_ptr() == source.data_ptr() and g.shape == source.shape and g.stride() == source.stride()
                and g.dtype == source.dtype)
        return result if same else None


class _ColumnInput(torch.autograd.Function):
    """Forward: the full input (all-gather of the sequence blocks under SP, else x itself);
    backward: the early collective's result, or the collective on the received gradient."""

    @staticmethod
    def forward(ctx, x, handoff):
        ctx.handoff = handoff
        if handoff.sequence_parallel:
            return C.all_gather(x, handoff.axis, handoff.dim)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        h = ctx.handoff
        early = h.take(g)
        if early is not None:
            return early, None
        if h.sequence_parallel:
            return C.reduce_scatter(g, h.axis, h.dim), None
        return C.all_reduce(g, h.axis), None


def column_input(x: torch.Tensor, axis: Axis, sequence_parallel: bool, dim: int = 1):
    """(x_full, handoff): the column product's input and the handoff its backward launches
    the input-gradient collective on; handoff is None on a group of one (nothing to reduce)."""
    if axis.size == 1:
        return x, None
    handoff = InputGradHandoff(axis, sequence_parallel, dim)
    return _ColumnInput.apply(x, handoff), handoff
