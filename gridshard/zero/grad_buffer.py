"""ZeRO-0: data-parallel gradient averaging over a persistent flat gradient buffer, in buckets.

Layout (allocated once, at construction). The trainable parameters are grouped by
(dtype, device); each group gets one flat buffer of Σ numel elements, parameter after
parameter in model order, and every parameter's ``.grad`` is a *view* of its slice::

    buffer  [ p0 | p1 | p2 | p3 | p4 ]          p.grad = buffer[off_p : off_p + numel_p].view_as(p)
    buckets [ p0 p1 | p2 | p3 p4 ]              consecutive slices of at most ``bucket_bytes``
                                                (:func:`gridshard.theory.training.bucket_partition`)

Autograd accumulates into an existing ``.grad`` in place (``grad += new``), so every micro-batch's
backward sums straight into the buffer; :meth:`zero_grad` zeroes it for the next step (never
reallocates). A bucket is a contiguous slice, so its reduction is one in-place
:func:`gridshard.comm.collectives.all_reduce` of the slice (recorded in the ledger) followed by
``÷ D``: no concatenation before and no copy back after. Bytes per step are
:func:`gridshard.theory.training.dp_gradient_allreduce`.

Overlap with the backward pass (``overlap=True``): :meth:`arm` before the last micro-batch's
backward; a post-accumulate-grad hook on every parameter counts its bucket's ready gradients,
and the moment a bucket is complete its all-reduce is issued asynchronously while autograd goes
on with earlier layers. :meth:`sync` issues any bucket still pending (e.g. parameters that got
no gradient), then waits for all of them in issue order. Every data rank runs the same graph, so
the buckets complete, and their collectives are issued, in the same order on every rank.
Without ``arm`` (or with ``overlap=False``) ``sync`` reduces every bucket after the backward.

With D = 1 in fp32 nothing is reduced, so there is no buffer: the gradients are autograd's own (no
zeroing pass, no in-place add on the first micro-batch; :meth:`zero_grad` drops them, as a plain
loop does), and :meth:`sync` is a no-op.

Whatever replaces a parameter's ``.grad`` (``optimizer.zero_grad(set_to_none=True)``,
``model.zero_grad()``) is undone by :meth:`zero_grad`, which re-attaches the views.

bf16 storage (``train.precision: bf16``, ``param_dtype`` bf16): the parameters are cast to
bf16 here, once, after their fp32 values are copied into one flat fp32 *master* buffer per
group (views shaped as the parameters); the gradient buffer is bf16 (autograd accumulates in
the parameter dtype) and is kept at D = 1 too. What the optimizer steps is the masters, whose
``.grad`` are views of an fp32 *master gradient* buffer that exists from :meth:`sync` to
:meth:`after_step` (it is freed there, after the masters are copied into the bf16
parameters). ``grad_reduce_dtype``: ``fp32`` — each bucket is cast into its slice of the
master gradient and all-reduced there; ``bf16`` — the bf16 bucket is all-reduced in place and
cast into the master gradient after. Per parameter between steps: 2 (param) + 2 (grad) + 4
(master) + 8 (moments) = 16 bytes, and 4 more from the reduction to the step.

Tensor-parallel partial gradients (``shard_spec.partial_grad_axes``, e.g. sequence-parallel
norm weights) are already reduced inside their layers (:mod:`gridshard.nn.norm`); this module
does not touch the tensor group.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..comm import collectives as C
from ..theory.training import bucket_partition
from .flat_layout import FlatLayout
from .reducer import SteppedTensor, whole_parameters


class DataParallelGradSync:
    """Averages the gradients of ``model``'s trainable parameters over ``data_axis`` (a
    :class:`gridshard.mesh.Axis`): the ZeRO-0 :class:`gridshard.zero.reducer.GradReducer`."""

    norm_axis = None                                   # every rank holds whole gradients

    def __init__(self, model: nn.Module, data_axis, bucket_bytes: int = 25 << 20, overlap: bool = True,
                 param_dtype: torch.dtype = torch.float32, grad_reduce_dtype: torch.dtype = torch.float32):
        self.model, self.axis = model, data_axis
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.overlap = overlap and data_axis.size > 1
        self.mixed = param_dtype != torch.float32      # bf16 storage with fp32 masters (module docstring)
        self.reduce_fp32 = not self.mixed or grad_reduce_dtype == torch.float32
        # D = 1 in fp32: nothing to reduce, autograd's own gradients
        self.persistent = data_axis.size > 1 or self.mixed
        self.buffers, self.buckets, self.bucket_flats = [], [], []
        self.masters, self.master_grads, self.master_views, self.master_bucket_flats = [], [], [], []
        self.master_grad_views: list = []              # the masters' gradient views, in self.params order
        self.views: list = []                          # parameter → its gradient view, in self.params order
        where = self._allocate(bucket_bytes, param_dtype)
        self.zero_grad()
        self._armed = False
        self._pending: dict = {}                       # bucket index -> PendingCollective
        self._ready = [0] * len(self.buckets)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook(where[id(p)]))
        model.grad_reducer = self

    def _allocate(self, bucket_bytes: int, param_dtype: torch.dtype) -> dict:
        """One zeroed buffer per (dtype, device), the gradient views and the bucket slices
        (buckets only, without a buffer, at D = 1 in fp32); bf16 storage: the masters first
        (:meth:`_store_in`); returns id(parameter) → bucket index."""
        groups: dict = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        view_of, where, master_of = {}, {}, {}
        for (dtype, device), ps in groups.items():
            layout = FlatLayout.of([p.numel() for p in ps])
            offsets = layout.offsets
            if self.mixed:
                master_of.update(self._store_in(layout, ps, param_dtype))
                dtype = param_dtype
            buffer = torch.zeros(layout.padded if self.persistent else 0, dtype=dtype, device=device)
            views = layout.views(buffer, [p.shape for p in ps]) if self.persistent else [None] * len(ps)
            view_of.update((id(p), v) for p, v in zip(ps, views))
            reduce_bytes = 4 if self.mixed and self.reduce_fp32 else buffer.element_size()   # what is on the wire
            for idx in bucket_partition([p.numel() for p in ps], reduce_bytes, bucket_bytes):
                start, stop = offsets[idx[0]], offsets[idx[-1]] + ps[idx[-1]].numel()
                for i in idx:
                    where[id(ps[i])] = len(self.buckets)
                self.buckets.append([ps[i] for i in idx])
                if self.persistent:
                    self.bucket_flats.append(buffer[start:stop])
                if self.mixed:
                    self.master_bucket_flats.append(self.master_grads[-1][start:stop])
            if self.persistent:
                self.buffers.append(buffer)
        self.views = [view_of[id(p)] for p in self.params]
        if self.mixed:
            self.master_views = [master_of[id(p)][0] for p in self.params]
            self.master_grad_views = [master_of[id(p)][1] for p in self.params]
        for g in self.master_grads:                    # storage from sync to after_step only
            g.untyped_storage().resize_(0)
        return where

    @torch.no_grad()
    def _store_in(self, layout: FlatLayout, ps: list, param_dtype: torch.dtype) -> dict:
        """bf16 storage: one fp32 master buffer of the group holding the parameters' values,
        an fp32 master-gradient buffer (no storage until :meth:`sync`, which attaches its views as
        the masters' ``.grad``), then the parameters cast to ``param_dtype``; returns
        id(parameter) → (its master view, its master-gradient view)."""
        first = ps[0]
        master = torch.zeros(layout.padded, dtype=torch.float32, device=first.device)
        grads = torch.zeros(layout.padded, dtype=torch.float32, device=first.device)
        shapes = [p.shape for p in ps]
        out = {}
        for p, m, g in zip(ps, layout.views(master, shapes), layout.views(grads, shapes)):
            m.copy_(p.detach())
            p.data = p.detach().to(param_dtype)
            out[id(p)] = (m, g)
        self.masters.append(master)
        self.master_grads.append(grads)
        return out

    def _hook(self, index: int):
        def on_grad_ready(_param):
            if not self._armed:
                return
            self._ready[index] += 1
            if self._ready[index] == len(self.buckets[index]):
                self._launch(index)
        return on_grad_ready

    def arm(self) -> None:
        """The next backward is the step's last: reduce each bucket as soon as it is complete."""
        if self.overlap:
            self._armed, self._pending, self._ready = True, {}, [0] * len(self.buckets)

    @torch.no_grad()
    def _launch(self, index: int) -> None:
        """Issue bucket ``index``'s all-reduce (bf16 storage with an fp32 reduce: of its fp32 cast,
        in the master gradient; nothing to reduce at D = 1)."""
        flat = self.bucket_flats[index]
        if self.mixed:
            self._master_grads_live()
            if self.reduce_fp32:
                flat = self.master_bucket_flats[index]
                flat.copy_(self.bucket_flats[index])
        if self.axis.size > 1:
            self._pending[index] = C.all_reduce(flat, self.axis, async_op=True, inplace=True)
        else:
            self._pending[index] = None

    def _master_grads_live(self) -> None:
        for g in self.master_grads:
            if g.untyped_storage().nbytes() == 0:
                g.untyped_storage().resize_(g.numel() * g.element_size())

    def _finish(self, index: int, pending) -> None:
        """Wait for bucket ``index``'s reduction and divide by D (into the master gradient under bf16
        storage)."""
        if pending is not None:
            pending.wait()
        if not self.mixed:
            self.bucket_flats[index].div_(self.axis.size)
        elif self.reduce_fp32:
            self.master_bucket_flats[index].div_(self.axis.size)
        else:
            self.master_bucket_flats[index].copy_(self.bucket_flats[index]).div_(self.axis.size)

    def bucket_elems(self) -> list:
        return [sum(p.numel() for p in b) for b in self.buckets]

    @torch.no_grad()
    def sync(self) -> None:
        """Replace every gradient by its mean over the data ranks (D = 1: a parameter without a
        gradient gets zeros, as every parameter has one at D > 1, so AdamW steps it alike)."""
        if not self.persistent:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        self._armed = False
        for index in range(len(self.buckets)):         # buckets not issued during backward
            if index not in self._pending:
                self._launch(index)
        order, self._pending = list(self._pending.items()), {}
        for index, pending in order:
            self._finish(index, pending)
        for m, g in zip(self.master_views, self.master_grad_views):
            m.grad = g

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the buffers in place; re-attach any view something else replaced (D = 1: drop
        the gradients)."""
        if not self.persistent:
            for p in self.params:
                p.grad = None
            return
        for buffer in self.buffers:
            buffer.zero_()
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    @torch.no_grad()
    def after_step(self) -> None:
        """fp32: nothing to refresh, every data rank stepped the whole parameters alike. bf16
        storage: copy the masters into the parameters and free the master gradient."""
        if not self.mixed:
            return
        for p, m in zip(self.params, self.master_views):
            p.copy_(m)
            m.grad = None
        for g in self.master_grads:
            g.untyped_storage().resize_(0)

    def free_all(self) -> None:
        """Nothing is gathered at ZeRO-0."""

    def gathered(self):
        return contextlib.nullcontext()

    # ---- what the optimizer, the norm and the checkpoint see -------------------------------
    def stepped(self) -> list:
        if not self.mixed:
            return list(whole_parameters(self.model))
        master_of = {id(p): m for p, m in zip(self.params, self.master_views)}
        return [SteppedTensor(s.name, s.param, master_of.get(id(s.param), s.tensor))
                for s in whole_parameters(self.model)]

    def optimizer_tensors(self) -> list:
        if not self.mixed:
            return list(self.named)
        return [(n, m) for (n, _), m in zip(self.named, self.master_views)]

    def norm_tensors(self) -> list:
        if not self.mixed:
            return [(p, p) for p in self.params]
        return list(zip(self.master_views, self.params))

    def memory_tensors(self) -> list:
        """bf16 storage: the master buffers and master gradients (fp32: none, the buffers are the
        gradients' storage)."""
        return self.masters + self.master_grads

