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
and handed to the product (:func:`gridshard.tensor.tp1d.linear.column_product`). Exactness does not
depend on autograd's routing: the entry uses the early result only if the gradient it
receives *is* the tensor the product launched the collective on (the product was the input's
only consumer); otherwise it reduces the gradient it received, as the two-node order does.
The early all-reduce runs on a copy (the tensor handed to autograd is never written while in
flight); the reduce-scatter is out of place anyway. Ledger entries are the same calls and bytes
with overlap on or off.

Sequence parallelism: the shard is saved, the full input re-gathered in backward
--------------------------------------------------------------------------------
Under SP the product's input is the all-gather of the sequence blocks, x = [x_0; …; x_{T−1}]
along the sequence, s·b·in elements, of which rank t owns s/T·b·in. The weight gradient
needs the whole x, but keeping it for backward would store T times the rank's share of the
residual stream. So, as Megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``
does, the product saves only the block x_t (handed over by the entry: :meth:`InputGradHandoff.take_block`)
and its backward

1. starts the all-gather of x_t again (:meth:`InputGradHandoff.regather`; asynchronous when the
   sequence is outermost in memory, the layout SP activations have),
2. computes ∂L/∂x = g·W and starts its reduce-scatter (:meth:`InputGradHandoff.launch`),
3. waits for the all-gather and computes ∂L/∂W_t = gᵀ·x from it; the gathered x is dropped
   when the backward returns.

The re-gathered x is bit-for-bit the forward's (the same blocks in the same order; under
autocast the block is cast to the compute dtype before it is saved, and a cast commutes with a
gather), so gradients do not change. Cost per column layer and step: one more all-gather of
s·b·in·e bytes in the ledger, (T−1)/T of it on each rank's wire, in exchange for s·b·in·e·(T−1)/T
fewer bytes kept. A backward that wants no weight gradient skips it. Inside a recomputed region
(``train.recompute=full``) the recomputation gathers x once more for its forward, and the
backward still gathers the saved block again: three gathers of x per step instead of two, as in
Megatron. With ``overlap`` off (``parallel.overlap_input_grad: false``) the same block is saved
and re-gathered; only the input gradient's collective waits for the entry node. Under the
``zero_bubble`` pipeline schedule the product's backward can run in both the input pass and the
deferred weight pass (``torch.distributed.pipelining`` re-runs it from its saved gradient), and
each run that computes the weight gradient re-gathers: measured at P = 2, T = 2, V = 2 with SP,
72 re-gathers on rank 0 over 3 steps where interleaved 1F1B has 48 (the same losses bit for bit). Skipping it in the input
pass would need :func:`gridshard.torch_private.will_execute` on the weights' accumulator nodes, which
torch 2.13 refuses inside ``autograd.grad``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...mesh import Axis
from ...comm import collectives as C


class InputGradHandoff:
    """The early input-gradient collective of one forward, from the product's backward
    (:meth:`launch`) to the entry's backward (:meth:`take`); under SP also the sequence block,
    from the entry's forward (:meth:`keep_block`) to the product's (:meth:`take_block`), and its
    all-gather again in backward (:meth:`regather`)."""

    def __init__(self, axis: Axis, sequence_parallel: bool, dim: int, overlap: bool = True):
        self.axis, self.sequence_parallel, self.dim, self.overlap = axis, sequence_parallel, dim, overlap
        self._pending = self._source = self._block = None

    def keep_block(self, block: torch.Tensor) -> None:
        """The entry's forward leaves its input (this rank's sequence block) for the product."""
        self._block = block

    def take_block(self) -> Optional[torch.Tensor]:
        """This rank's sequence block, once (the product saves it instead of the gathered input;
        holding it here longer would keep it alive outside autograd's saved tensors)."""
        block, self._block = self._block, None
        return block

    def regather(self, block: torch.Tensor) -> C.PendingCollective:
        """Start the all-gather of a saved block again (backward); ``wait()`` gives the full input,
        in the layout the forward's gather gave it. Asynchronous when ``dim`` is outermost in memory
        (SP activations are stored sequence-first), else completed here."""
        if block.movedim(self.dim % block.dim(), 0).is_contiguous():
            return C.all_gather(block, self.axis, self.dim, async_op=True)
        return C.PendingCollective(None, C.all_gather(block, self.axis, self.dim), None)

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
            handoff.keep_block(x)
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


def column_input(x: torch.Tensor, axis: Axis, sequence_parallel: bool, dim: int = 1, overlap: bool = True):
    """(x_full, handoff): the column product's input and the handoff its backward launches
    the input-gradient collective on (``overlap``; else the entry runs it on the gradient it
    receives) and, under SP, takes the sequence block to save from; handoff is None on a group
    of one (nothing to gather or reduce)."""
    if axis.size == 1:
        return x, None
    handoff = InputGradHandoff(axis, sequence_parallel, dim, overlap)
    return _ColumnInput.apply(x, handoff), handoff
