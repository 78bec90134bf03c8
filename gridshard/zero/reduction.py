"""Gradient reduction at every ZeRO stage (:class:`GradientReduction`; the methods named below are
its own): accumulation over micro-batches, the all-reduce / reduce-scatter launched as units
complete, the step's communication. The units and buffers it acts on: :mod:`.units`; ZeRO-3's
gathering: :mod:`.gather`.

bf16 storage (``param_dtype`` bf16, ``train.precision: bf16``): the parameter and gradient
buffers are bf16; each unit also holds its *master chunk* [C_u] fp32 (ZeRO-0: the whole unit;
ZeRO-3: it is the unit's parameter chunk, no bf16 copy is kept), copied from the fp32 values
before the parameters are cast — that is what the optimizer steps, its ``.grad`` the fp32
reduced chunk. ``grad_reduce_dtype``
fp32: ZeRO-0 casts each bucket into its fp32 reduced buffer and all-reduces that in place;
ZeRO ≥ 1 reduce-scatters an fp32 cast of the gradient buffer (alive while in flight). bf16: the
bf16 buffer is reduced (all-reduced in place; reduce-scattered into a bf16 chunk) and cast into
(or added to) the fp32 reduced chunk. ZeRO-0's reduced buffer exists from the reduction to
:meth:`after_step`, and a bucket's bf16 gradient buffer is freed as soon as the bucket is in it
(given its storage back, for the next step, in :meth:`after_step`): per parameter between steps
2 (param) + 2 (grad) + 4 (master) + 8 (moments) = 16 bytes, from the reduction to the step
2 + 4 + 4 (reduced) + 8 = 18. :meth:`after_step` first copies each master chunk into the bf16
parameter chunk (ZeRO-1/2), so the all-gathers move bf16; ZeRO-3's gathers cast the master chunk
into the bf16 buffer's own slice and all-gather bf16 from there (:mod:`.gather`): the same
rounding of the same fp32 values, 16 bytes per parameter over D.

bf16 storage with A > 1 micro-batches (ZeRO-0/1 with ``overlap``: P = 1, D > 1): the micro-batches
are summed in fp32, as ZeRO-2/3's sharded accumulation and Megatron's fp32 main gradient do, not
by autograd's ``grad += new`` in bf16. When a unit's gradients of a micro-batch before the last
are complete (the post-accumulate-grad hooks count them; the reducer is not yet armed), they
are added into the unit's fp32 *accumulator* [L_u] (the first one copied) and the bf16 gradient
buffer is zeroed for the next micro-batch — ZeRO-0: the accumulator is the bucket's fp32 reduced
buffer, given its storage at the first micro-batch instead of at the reduction; ZeRO-1: a
separate [L_u] fp32 buffer, freed once reduced. The last micro-batch's reduction adds the bf16
buffer into it and reduces the sum: with an fp32 reduce, ZeRO-0 all-reduces the reduced buffer
in place, ZeRO-1 reduce-scatters the accumulator itself (no separate fp32 cast); with
``grad_reduce_dtype`` bf16 the fp32 sum is cast once into the bf16 gradient buffer and that is
reduced as with one micro-batch (one bf16 rounding of each rank's sum, where ZeRO-2/3 round each
micro-batch's reduce-scatter). Per parameter during the backward of micro-batches 2..A: + 4 bytes
(ZeRO-0: 2 + 2 + 4 + 4 + 8 = 20, then 18 from the reduction to the step;
:func:`gridshard.theory.memory.zero_accumulator_bytes`). One micro-batch is unchanged (no
accumulator, the same bytes and values). At D = 1 and without overlap (ZeRO-0/1 with a pipeline,
``train.overlap_grad_reduce=false``, the ``zero_bubble`` schedule) no hook runs and every stage
sums the micro-batches in its bf16 gradient buffer (ZeRO-2/3 too: no sharded accumulation there).

One step, ``A`` micro-batches:

1. backward of every micro-batch accumulates into the gradient buffers (bf16 ZeRO-0/1 with
   A > 1: into the fp32 accumulator, above; ZeRO-2/3 allocate a
   unit's buffer — ``untyped_storage().resize_`` and zero; ZeRO-3 with host pages: its released
   mapping, which reads zeros — when its backward starts: a hook
   on each parameter's gradient runs before autograd accumulates it);
2. the moment a unit's gradients are complete (a post-accumulate-grad hook counts them), its
   reduction is issued asynchronously — ZeRO-0 one in-place ``all_reduce`` of the bucket,
   ZeRO ≥ 1 one ``reduce_scatter`` of the unit's gradient buffer into its reduced chunk; no
   packing, buffers and chunks are contiguous — in the last micro-batch's backward (ZeRO-0/1,
   after :meth:`arm`), in *every* micro-batch's (ZeRO-2/3: *sharded accumulation*, a later
   micro-batch's result is added into the chunk, so no full gradient survives between
   micro-batches; also with pipeline stages, whose schedule runs each micro-batch's backward
   through ``torch.autograd.backward``, but not ``zero_bubble``, whose weight pass bypasses the
   hooks: :func:`gridshard.theory.zero.sharded_accumulation`); without ``overlap`` (ZeRO-0/1
   with a pipeline, ``zero_bubble``, or ``train.overlap_grad_reduce=false``) once, after the
   last backward. With ``defer_root`` (a pipeline stage holding a tied embedding's copy) the
   root unit is reduced in :meth:`sync` only, after
   :class:`gridshard.pipeline.tied.TiedEmbeddingSync` summed the copies' whole gradients.
   ZeRO ≥ 1 keep at most ``MAX_IN_FLIGHT`` outstanding
   (launching another first waits for the oldest, *before* the new one's fp32 cast exists, so at
   most ``MAX_IN_FLIGHT`` casts are ever alive) and free a gradient buffer's storage once
   its reduce-scatter is done (ZeRO-2/3; a new gradient for the unit first finishes a
   reduce-scatter still in flight) — or, under bf16 storage with an fp32 reduce, right after its
   fp32 cast, which is what is sent (FSDP2 frees the unsharded gradient at the same point).
   Every data rank runs the same graph, so the units complete, and their collectives are
   issued, in the same order on every rank;
3. :meth:`sync` issues what is still pending, waits for the rest, divides by D (the sum over
   data ranks and micro-batches → the mean) and hands each stepped tensor its slice of the
   reduced chunk as ``.grad``;
4. clipping and AdamW act on the stepped tensors (ZeRO ≥ 1: the norm counts each element once,
   sum of squares over tensor *and* data ranks: ``norm_axis``);
5. :meth:`after_step` (ZeRO-1/2): one in-place ``all_gather`` per unit of the parameter
   buffer from this rank's chunk of it (all issued, then all waited for) — the parameters
   are views, nothing to unpack.


Communication per step and rank (payloads as the ledger records them, S_u = L_u elements,
4 bytes each):

* ZeRO-0: one all-reduce of each bucket (:func:`gridshard.theory.training.dp_gradient_allreduce`);
* ZeRO-1/2: one reduce-scatter of S_u (ZeRO-2 with sharded accumulation: one per micro-batch)
  and one all-gather of S_u per unit — on a ring (D−1)/D·S_u each, together the wire bytes of
  the all-reduce they replace (up to padding; :func:`gridshard.theory.zero.zero_step_comm`);
* ZeRO-3: one reduce-scatter per unit (per micro-batch with sharded accumulation), two
  all-gathers per decoder layer and micro-batch (forward and backward) and one per step for
  the root unit — with one micro-batch 1.5× the all-reduce's wire bytes.

Tensor-parallel partial gradients (``shard_spec.partial_grad_axes``, e.g. sequence-parallel
norm weights) are already reduced inside their layers (:mod:`gridshard.nn.norm`); this module
does not touch the tensor group.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import collectives as C
from .pages import StagingPool, StagingSlots
from .settings import ReadsSettings, ZeroSettings
from .units import Unit


class GradientReduction(ReadsSettings, StagingSlots):
    """The reduction of ``units``' gradients over ``axis`` under ``settings`` (module docstring):
    the hooks autograd calls (:meth:`before_accumulate`, :meth:`on_grad`), the reductions issued
    in the backward or in :meth:`sync`, and the step's bookends :meth:`after_step` and
    :meth:`zero_grad`. ``staging``: the reducer's pool or None; ``gathering``: the
    :class:`~.gather.ParameterGather` whose units are freed once their gradients are complete."""

    def __init__(self, settings: ZeroSettings, axis, units: list, staging: Optional[StagingPool], gathering):
        self.settings, self.axis, self.units, self.staging, self.gathering = settings, axis, units, staging, gathering
        self._armed = False
        self._in_flight: list = []                     # units whose reduction is outstanding, oldest first

    @torch.no_grad()
    def _ensure_grad_buffer(self, u: Unit) -> None:
        """ZeRO-2/3: give ``u``'s gradient buffer its storage back, zeroed, before the first
        gradient of its backward is accumulated (a reduce-scatter of the previous micro-batch's
        still in flight is finished first: it frees the buffer)."""
        if u.pending is not None:
            self._in_flight.remove(u)
            self._finish(u)
        if not u.grads_live:
            if u.grad_pages is not None:
                u.grad_pages.restore(zero=True)
            else:
                u.grad_buffer.untyped_storage().resize_(u.nbytes)
                u.grad_buffer.zero_()
            u.grads_live = True
        u.attach_grads()

    def before_accumulate(self, u: Unit):
        return lambda _grad: self._ensure_grad_buffer(u)

    def on_grad(self, u: Unit):
        def on_grad_ready(_param):
            u.unreduced = True
            u.ready += 1
            if u.ready < len(u.params):
                return
            u.ready = 0
            if (self._armed or self._shards_now(u)) and u.pending is None:
                self._launch(u)
            elif self.fp32_accumulation and not self._armed:
                self._accumulate(u)
            if self.stage == 3 and u.name != "root":
                self.gathering.free(u)
        return on_grad_ready

    def _shards_now(self, u: Unit) -> bool:
        """Sharded accumulation reduces ``u`` now, at the end of a micro-batch's backward: every
        unit but a deferred root (``defer_root``: ``sync()`` reduces it once the tied-embedding
        copies' whole gradients are summed across stages)."""
        return self.sharded_accumulation and not (self.defer_root and u.name == "root")

    def arm(self) -> None:
        """The next backward is the step's last: reduce each unit as soon as it is complete."""
        if self.overlap:
            self._armed = True
            for u in self.units:
                u.ready = 0

    @torch.no_grad()
    def _accumulate(self, u: Unit) -> None:
        """bf16 storage, ZeRO-0/1, a micro-batch before the last: add ``u``'s bf16 gradients into its
        fp32 accumulator (given its storage by the first) and zero the gradient buffer for the next."""
        if u.accumulated:
            u.accum.add_(u.grad_buffer)
        else:
            u.accum.untyped_storage().resize_(u.layout.padded * 4)
            u.accum.copy_(u.grad_buffer)
            u.accumulated = True
        u.grad_buffer.zero_()

    def _drop_accum(self, u: Unit) -> None:
        """The accumulator is consumed: ZeRO-1 frees its storage (ZeRO-0's is the reduced buffer)."""
        u.accumulated = False
        if u.accum is not None and u.accum is not u.reduced:
            u.accum.untyped_storage().resize_(0)

    @torch.no_grad()
    def _launch(self, u: Unit) -> None:
        """Issue ``u``'s reduction (ZeRO-0: an all-reduce, ZeRO ≥ 1: a reduce-scatter) asynchronously."""
        if not u.grads_live:                           # no gradient reached the unit this step
            self._ensure_grad_buffer(u)
        while self.max_in_flight is not None and len(self._in_flight) >= self.max_in_flight:
            self._finish(self._in_flight.pop(0))       # first: u's fp32 cast never joins max_in_flight others
        u.pending = self._all_reduce(u) if self.stage == 0 else self._reduce_scatter(u)
        u.reductions, u.unreduced = u.reductions + 1, False
        if self.stage >= 2:
            for p in u.params:
                p.grad = None                          # the buffer is freed once reduced
        self._in_flight.append(u)

    def _all_reduce(self, u: Unit):
        """ZeRO-0: the bucket's in-place all-reduce — of the gradient buffer, or under bf16 storage
        with an fp32 reduce of its fp32 cast in the reduced buffer."""
        u.send = u.grad_buffer
        if self.mixed and self.reduce_fp32:
            u.send = self._cast_into_reduced(u)
        elif u.accumulated:                            # bf16 reduce: the fp32 sum of the micro-batches, cast once
            u.grad_buffer.copy_(u.accum.add_(u.grad_buffer))
            self._drop_accum(u)
        return C.all_reduce(u.send, u.axis, async_op=True, inplace=True)

    def _cast_into_reduced(self, u: Unit) -> torch.Tensor:
        """ZeRO-0 under bf16 storage: the bucket's fp32 reduced buffer gets its storage and the
        bf16 gradients, whose buffer is freed (what keeps the step at 18 bytes per parameter)."""
        if u.accumulated:                              # the reduced buffer is the accumulator: the last micro-batch
            u.reduced.add_(u.grad_buffer)
            u.accumulated = False
        else:
            u.reduced.untyped_storage().resize_(u.reduced.numel() * u.reduced.element_size())
            u.reduced.copy_(u.grad_buffer)
        self._free_grad_buffer(u)
        return u.reduced

    def _reduce_scatter(self, u: Unit):
        """ZeRO ≥ 1: reduce-scatter ``u``'s gradient buffer, the step's first into the reduced chunk,
        a later micro-batch's (sharded accumulation) into a scratch chunk added to it when done."""
        send = u.grad_buffer
        if u.accumulated:                              # bf16 ZeRO-1, A > 1: the last micro-batch into the fp32 sum
            u.accum.add_(u.grad_buffer)
            if self.reduce_fp32:
                send = u.send = u.accum                # reduced as it is, freed when done
            else:                                      # cast once, reduced in bf16
                u.grad_buffer.copy_(u.accum)
                self._drop_accum(u)
        elif self.mixed and self.reduce_fp32:          # bf16 storage, fp32 reduce: a transient fp32 cast
            send = u.send = u.grad_buffer.float()
            if self.stage >= 2:                        # the cast is what is sent: the bf16 buffer goes now
                self._free_grad_buffer(u)
        out = u.reduced
        if u.reductions or send.dtype != out.dtype:
            out = u.scratch = torch.empty(out.numel(), dtype=send.dtype, device=out.device)
            u.scratch_first = not u.reductions
        u.recv_slot = self._take_slot("reduce")
        return C.reduce_scatter_flat(send, u.axis, async_op=True, out=out,
                                     staging=self._slot_view(u.recv_slot, send.dtype))

    def _free_grad_buffer(self, u: Unit) -> None:
        """Release ``u``'s gradient buffer's storage (its ``.grad`` views dropped)."""
        for p in u.params:
            p.grad = None
        u.release_grads()
        u.grads_live = False

    def _finish(self, u: Unit) -> None:
        """Wait for unit ``u``'s reduction; ZeRO-0 bf16 reduce: cast it into the reduced buffer;
        ZeRO ≥ 1: add a later micro-batch's into the reduced chunk (ZeRO-2/3: free the gradient buffer)."""
        u.pending.wait()
        self._give_slot(u.recv_slot)
        u.recv_slot = None
        if u.send is u.grad_buffer and u.reduced is not u.grad_buffer:
            self._cast_into_reduced(u)
        if u.send is not None and u.send is u.accum:
            self._drop_accum(u)
        u.pending, u.send = None, None
        if u.scratch is not None:
            (u.reduced.copy_ if u.scratch_first else u.reduced.add_)(u.scratch)
            u.scratch = None
        if self.stage >= 2:
            self._free_grad_buffer(u)

    @torch.no_grad()
    def sync(self) -> None:
        """Finish the step's reduction: every stepped tensor gets the data-parallel mean of its
        elements' gradient (module docstring, step 3; ZeRO-0 at D = 1 in fp32: a parameter without
        a gradient gets zeros, as every parameter has one at D > 1, so AdamW steps it alike)."""
        self._armed = False
        if not self.persistent:
            for p in (p for u in self.units for p in u.params):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        for u in self.units:
            if u.pending is None and (u.unreduced or not u.reductions):
                self._launch(u)
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        for u in self.units:
            if self.axis.size > 1:                     # the sum over data ranks (and micro-batches) → mean;
                u.reduced.div_(self.axis.size)         # experts too: their sum covers all R ranks' tokens
            self._hand_grads(u)
            u.ready = 0
        self.gathering.free_all()                      # ZeRO-3: the root, and any layer that got no gradient

    def _hand_grads(self, u: Unit) -> None:
        """Each stepped tensor's ``.grad``: its slice of the reduced chunk (ZeRO-0 fp32: the
        parameters' own ``.grad`` already are)."""
        if self.stage:
            lo = u.layout.chunk(u.part)[0]
            where = {id(p): off for p, off in zip(u.params, u.layout.offsets)}
            for s in u.stepped:
                a, b = s.elements
                s.tensor.grad = u.reduced[where[id(s.param)] + a - lo:where[id(s.param)] + b - lo]
        elif self.mixed:
            for s, g in zip(u.stepped, u.layout.views(u.reduced, [p.shape for p in u.params])):
                s.tensor.grad = g

    @torch.no_grad()
    def after_step(self) -> None:
        """bf16 storage: copy every master chunk into the bf16 parameter chunk (ZeRO ≤ 2: this
        rank's chunk of the parameter buffer; ZeRO-3: nothing, the master is its parameter chunk,
        cast to bf16 by each gather); ZeRO-0 frees the
        reduced buffers and gives the gradient buffers their storage back. ZeRO-1/2: all-gather
        every unit's updated chunk into its parameter buffer, in place."""
        if self.mixed:
            for u in self.units:
                if u.param_chunk is not u.master:      # ZeRO-3: the master is the chunk, cast at each gather
                    u.param_chunk.copy_(u.master)
            self._end_reduction()
        if self.stage not in (1, 2):
            return
        pending = [C.all_gather_into(u.param_buffer, u.param_chunk, u.axis, async_op=True) for u in self.units
                   if u.axis.size > 1]
        for work in pending:
            work.wait()

    def _end_reduction(self) -> None:
        """ZeRO-0 under bf16 storage: free the reduced buffers and give the gradient buffers their
        storage back (zeroed and re-attached by :meth:`zero_grad`); no-op once done."""
        if self.stage or not self.mixed:
            return
        for u in self.units:
            for s in u.stepped:
                s.tensor.grad = None
            u.reduced.untyped_storage().resize_(0)
            if not u.grads_live:
                u.grad_buffer.untyped_storage().resize_(u.nbytes)
                u.grads_live = True

    def zero_grad(self) -> None:
        """Zero the gradient buffers that have storage (ZeRO-0/1: all, persistent; ZeRO-2/3 get
        theirs back, zeroed, when the unit's backward starts) and drop the stepped tensors'
        gradients (ZeRO-0, D = 1, fp32: drop autograd's gradients)."""
        self._end_reduction()                          # a skipped step has no after_step
        for u in self.units:
            u.reductions, u.unreduced = 0, False
            if u.accumulated:                          # a step abandoned before its reduction
                self._drop_accum(u)
            if not self.persistent:
                for p in u.params:
                    p.grad = None
            elif u.grads_live:
                u.grad_buffer.zero_()
                u.attach_grads()
            for s in u.stepped:
                if s.tensor is not s.param:
                    s.tensor.grad = None
