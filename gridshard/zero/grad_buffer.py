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

With D = 1 nothing is reduced, so there is no buffer: the gradients are autograd's own (no
zeroing pass, no in-place add on the first micro-batch; :meth:`zero_grad` drops them, as a plain
loop does), and :meth:`sync` is a no-op.

Whatever replaces a parameter's ``.grad`` (``optimizer.zero_grad(set_to_none=True)``,
``model.zero_grad()``) is undone by :meth:`zero_grad`, which re-attaches the views.

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
from .reducer import whole_parameters


class DataParallelGradSync:
    """Averages the gradients of ``model``'s trainable parameters over ``data_axis`` (a
    :class:`gridshard.mesh.Axis`): the ZeRO-0 :class:`gridshard.zero.reducer.GradReducer`."""

    norm_axis = None                                   # every rank holds whole gradients

    def __init__(self, model: nn.Module, data_axis, bucket_bytes: int = 25 << 20, overlap: bool = True):
        self.model, self.axis = model, data_axis
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.overlap = overlap and data_axis.size > 1
        self.persistent = data_axis.size > 1           # D = 1: nothing to reduce, autograd's own gradients
        self.buffers, self.buckets, self.bucket_flats = [], [], []
        self.views: list = []                          # parameter → its gradient view, in self.params order
        where = self._allocate(bucket_bytes)
        self.zero_grad()
        self._armed = False
        self._pending: dict = {}                       # bucket index -> PendingCollective
        self._ready = [0] * len(self.buckets)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook(where[id(p)]))
        model.grad_reducer = self

    def _allocate(self, bucket_bytes: int) -> dict:
        """One zeroed buffer per (dtype, device), the gradient views and the bucket slices
        (buckets only, without a buffer, at D = 1); returns id(parameter) → bucket index."""
        groups: dict = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        view_of, where = {}, {}
        for (dtype, device), ps in groups.items():
            layout = FlatLayout.of([p.numel() for p in ps])
            offsets = layout.offsets
            buffer = torch.zeros(layout.padded if self.persistent else 0, dtype=dtype, device=device)
            views = layout.views(buffer, [p.shape for p in ps]) if self.persistent else [None] * len(ps)
            view_of.update((id(p), v) for p, v in zip(ps, views))
            for idx in bucket_partition([p.numel() for p in ps], buffer.element_size(), bucket_bytes):
                start, stop = offsets[idx[0]], offsets[idx[-1]] + ps[idx[-1]].numel()
                for i in idx:
                    where[id(ps[i])] = len(self.buckets)
                self.buckets.append([ps[i] for i in idx])
                if self.persistent:
                    self.bucket_flats.append(buffer[start:stop])
            if self.persistent:
                self.buffers.append(buffer)
        self.views = [view_of[id(p)] for p in self.params]
        return where

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

    def _launch(self, index: int) -> None:
        self._pending[index] = C.all_reduce(self.bucket_flats[index], self.axis, async_op=True, inplace=True)

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
        order, self._pending = list(self._pending.values()), {}
        for pending in order:
            pending.wait().div_(self.axis.size)

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

    def after_step(self) -> None:
        """Nothing to refresh: every data rank stepped the whole parameters alike."""

    def free_all(self) -> None:
        """Nothing is gathered at ZeRO-0."""

    def gathered(self):
        return contextlib.nullcontext()

    # ---- what the optimizer, the norm and the checkpoint see -------------------------------
    def stepped(self) -> list:
        return list(whole_parameters(self.model))

    def optimizer_tensors(self) -> list:
        return list(self.named)

    def norm_tensors(self) -> list:
        return [(p, p) for p in self.params]

    def memory_tensors(self) -> list:
        return []                                      # the buffers are the gradients' storage

