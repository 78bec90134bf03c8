"""ZeRO-3 parameters (:class:`ParameterGather`). Between uses a unit's parameter buffer is
*released*: storage size 0, or with host pages (the default on a Linux CPU, :mod:`.pages`)
its own mapping with its pages handed back (:class:`~.pages.FlatPages`; the unit's ``gathered``
flag says which, and :meth:`~.data_parallel.ZeroDataParallel.released_tensors` lets memory
accounting count it 0). The parameter objects, their names and autograd identity stay; every view
sees the memory when it is back. With host pages the long-lived chunks (parameter — under bf16
storage the fp32 master —, reduced) and AdamW's moments of them are views of one arena mapping
(:class:`~.pages.ChunkArena`, :meth:`~.data_parallel.ZeroDataParallel.adam_moments`), and gloo's
all-gather and reduce-scatter transients are slots of a resident pool the reducer owns
(:class:`~.pages.StagingPool`: 2 gathers and ``MAX_IN_FLIGHT + 1`` reductions): glibc's heap then
holds only a step's activations (docs/memory.md "Resident memory on CPU"). And the heap is trimmed
(``malloc_trim(0)``, :meth:`ParameterGather.trim_before_regather`) as backward reaches each of its first
``TRIMMED_LAYERS`` = ``MAX_IN_FLIGHT + 1`` decoder layers, before the regather. Over those layers
the backward's own memory, outside the heap, grows to its steady state — the regathered layer and
the prefetched one, the gradient buffers of up to ``MAX_IN_FLIGHT + 1`` reductions, each
unit-sized — while the activations it frees stay resident in the heap: without the trim the
step's resident peak was there, above the forward's. The trims hand the free heap pages back as
that growth comes; later ones would only make the backward's own temporaries fault in again
(measured: a trim at every layer gave the same peak at 2.4× the extra page faults).

A forward pre-hook on the unit's module gathers it (memory back, one all-gather of the parameter
chunks into the buffer; under bf16 storage each rank first casts its fp32 master chunk into its own
slice of the bf16 buffer and all-gathers that in place: sharded fp32 parameters, bf16 all-gathers,
as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``); after
the forward the layer is freed again; an identity autograd function on the layer's outputs
gathers it again when backward reaches the layer (the saved activations refer to the same
storage, so they see the same values; the parameters' version counters are their own, not the
buffer's, so the write does not trip autograd's saved-tensor check); when the layer's gradients
are complete it is freed. The root unit stays gathered from its first use in forward to the
step's reduction (:meth:`~.reduction.GradientReduction.sync`): the head is the first thing every
backward needs and the embedding the first thing every forward needs. With
``train.recompute=full`` the recomputation runs inside the layer's backward, after the regather.

ZeRO-3 prefetch (with ``overlap``: ``train.overlap_grad_reduce`` at D > 1, P = 1 or a pipeline
schedule with sharded accumulation). When a
unit's gather starts a use of it, the gather of the unit that runs next is issued
asynchronously — in forward the next layer (the root's first use issues layer 0's), in
backward the previous layer — and waited for by that unit's own hook; at most one unit ahead,
so at most two decoder layers are gathered at once (+ the root). The collectives, their order
and the values are those without prefetch (``tests/test_zero.py``); only the order against
the computation changes.

"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..comm import collectives as C
from ..torch_private import in_backward, tree_map_only
from .pages import StagingPool, StagingSlots
from .settings import MAX_IN_FLIGHT

TRIMMED_LAYERS = MAX_IN_FLIGHT + 1


class _RegatherInBackward(torch.autograd.Function):
    """Identity on a layer's output whose backward gathers the layer's parameters (ZeRO-3):
    backward reaches a layer's outputs before anything inside the layer (``zero``: the
    :class:`ParameterGather`; with host pages it trims the heap first, module docstring)."""

    @staticmethod
    def forward(ctx, x, zero, unit):
        ctx.zero, ctx.unit = zero, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.zero.trim_before_regather()
        ctx.zero.gather(ctx.unit, ahead=-1)
        return grad, None, None


class ParameterGather(StagingSlots):
    """ZeRO-3's gathering of ``units``' parameters, each over its unit's axis (module docstring): hooks on their
    modules gather before a use and free after it, ``gather_order`` (the root, then the layers as
    the forward runs them) says which unit to prefetch; ``zero3``: the stage is 3 (below, every
    unit stays gathered and this is a no-op). ``staging``: the reducer's pool or None;
    ``trim_heap``: glibc's ``malloc_trim`` with host pages, else None (``trimmer``), called after
    construction and in the first ``TRIMMED_LAYERS`` layers of each backward."""

    def __init__(self, units: list, overlap: bool, zero3: bool, staging: Optional[StagingPool],
                 trim_heap: Optional[Callable[[int], int]]):
        self.units, self.overlap, self.zero3 = units, overlap, zero3
        self.staging, self.trimmer = staging, trim_heap
        self._trims_left = 0                           # heap trims left in the coming backward
        # ZeRO-3 prefetch order: the root (embedding first), then the layers as the forward runs them
        self.gather_order = [u for u in units if u.name == "root"] + [u for u in units if u.name != "root"]

    def trim_heap(self) -> None:
        """Host pages: hand glibc's free heap pages back to the system (module docstring); else nothing."""
        if self.trimmer is not None:
            self.trimmer(0)

    def trim_before_regather(self) -> None:
        """Backward reached a layer: trim the heap if it is one of the backward's first
        ``TRIMMED_LAYERS`` (module docstring)."""
        if self._trims_left > 0:
            self._trims_left -= 1
            self.trim_heap()

    def install_hooks(self) -> None:
        for u in self.units:
            for module in u.modules:
                module.register_forward_pre_hook(self._pre_forward(u))
                if u.name != "root":
                    module.register_forward_hook(self._post_forward(u))

    def _pre_forward(self, u):
        # a forward inside backward (full recompute) finds its unit gathered: nothing to prefetch
        return lambda _module, _args: self.gather(u, ahead=0 if in_backward() else 1)

    def _post_forward(self, u):
        def hook(_module, _args, output):
            self.free(u)
            if not torch.is_grad_enabled():
                return output
            self._trims_left = TRIMMED_LAYERS          # this forward's backward comes
            return tree_map_only(torch.Tensor, lambda x: _RegatherInBackward.apply(x, self, u)
                                 if x.requires_grad else x, output)
        return hook

    # ---- ZeRO-3 gather / free ----------------------------------------------------------------
    @torch.no_grad()
    def gather(self, u, ahead: int = 0) -> None:
        """All-gather unit ``u``'s parameter chunks into its parameter buffer (no-op if gathered —
        always, below ZeRO-3; waited for if prefetched): every parameter, a view of the buffer,
        sees the whole values. ``ahead`` = ±1 (with ``overlap``): then issue, asynchronously,
        the gather of the unit that runs next — the next in forward (+1), the previous layer in
        backward (−1) — so it moves while this one computes; at most one unit ahead (issue 27's
        prefetch; the same collectives, in the same order on every rank, as without it)."""
        fresh = u.prefetch is not None or not u.gathered          # this call starts a use of u
        self._prefetch(u)                                         # not gathered nor prefetched: issued now
        if u.prefetch is not None:
            self._wait_prefetch(u)
        if ahead and fresh and self.overlap:
            i = self.gather_order.index(u) + ahead
            if 0 <= i < len(self.gather_order) and self.gather_order[i].name != "root":
                self._prefetch(self.gather_order[i])

    def _prefetch(self, u) -> None:
        if u.gathered or u.prefetch is not None:
            return
        u.param_pages.restore()
        send = u.param_chunk
        if send.dtype != u.param_buffer.dtype:         # bf16 storage: the fp32 master, cast into its own slice
            lo, hi = u.layout.chunk(u.part)
            send = u.param_buffer[lo:hi].copy_(send)
        u.send_slot = self._take_slot("gather")
        u.prefetch = C.all_gather_into(u.param_buffer, send, u.axis, async_op=True,
                                       staging=self._slot_view(u.send_slot, u.param_buffer.dtype))
        u.gathered = True

    def _wait_prefetch(self, u) -> None:
        u.prefetch.wait()
        u.prefetch = None
        self._give_slot(u.send_slot)
        u.send_slot = None

    def free(self, u) -> None:
        """ZeRO-3: release ``u``'s parameter buffer (a prefetch never used is waited for first)."""
        if not self.zero3 or not u.gathered:
            return
        if u.prefetch is not None:                     # issued ahead but never used (e.g. a forward cut short)
            self._wait_prefetch(u)
        u.param_pages.release()
        u.gathered = False

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole on every data rank inside the block (ZeRO-3: one all-gather per
        unit; a collective, every rank enters it); freed again after."""
        for u in self.units:
            self.gather(u)
        try:
            yield
        finally:
            self.free_all()

    def free_all(self) -> None:
        """ZeRO-3: free every gathered unit (e.g. the root after an evaluation); no-op below."""
        for u in self.units:
            self.free(u)
