"""Data-parallel gradient averaging through gridshard's recorded all-reduce, in buckets.

Each rank's gradients are packed in order into flat buffers of at most ``bucket_bytes``
(one dtype/device per bucket); each buffer is summed over ``mesh.data`` with
:func:`gridshard.comm.collectives.all_reduce` (so the ledger records it), divided by D
and copied back. Bytes per step are :func:`gridshard.theory.training.dp_gradient_allreduce`.

Overlap with the backward pass (``overlap=True``): :meth:`arm` before the last
micro-batch's backward; a post-accumulate-grad hook on every parameter counts the
bucket's ready gradients, and the moment a bucket is complete its all-reduce is issued
asynchronously while autograd goes on with earlier layers. :meth:`sync` issues any
bucket still pending (e.g. parameters that got no gradient), then waits for all of
them in issue order. Every data rank runs the same graph, so the buckets complete, and
their collectives are issued, in the same order on every rank. Without ``arm`` (or with
``overlap=False``) ``sync`` reduces every bucket after the backward.

Tensor-parallel partial gradients (``shard_spec.partial_grad_axes``, e.g. sequence-
parallel norm weights) are already reduced inside their layers (see
:mod:`gridshard.nn.norm`); this module does not touch the tensor group.
"""
from __future__ import annotations

import torch

from ..comm import collectives as C
from ..theory.training import bucket_partition


class DataParallelGradSync:
    """Averages gradients of ``params`` over ``data_axis`` (a :class:`gridshard.mesh.Axis`)."""

    def __init__(self, params, data_axis, bucket_bytes: int = 25 << 20, overlap: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.axis = data_axis
        self.overlap = overlap and data_axis.size > 1
        self.buckets = []
        groups: dict = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, _), ps in groups.items():
            parts = bucket_partition([p.numel() for p in ps], torch.empty(0, dtype=dtype).element_size(),
                                     bucket_bytes)
            self.buckets += [[ps[i] for i in idx] for idx in parts]

        self._armed = False
        self._pending: dict = {}                       # bucket index -> PendingCollective
        self._ready = [0] * len(self.buckets)
        if self.overlap:
            where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook(where[id(p)]))

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
        bucket = self.buckets[index]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self._pending[index] = C.all_reduce(flat, self.axis, async_op=True, inplace=True)

    def bucket_elems(self) -> list:
        return [sum(p.numel() for p in b) for b in self.buckets]

    @torch.no_grad()
    def sync(self) -> None:
        """Replace every gradient by its mean over the data ranks (no-op when D = 1)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.axis.size == 1:
            return
        self._armed = False
        for index in range(len(self.buckets)):         # buckets not issued during backward
            if index not in self._pending:
                self._launch(index)
        order, self._pending = list(self._pending.items()), {}
        for index, pending in order:
            bucket = self.buckets[index]
            flat = pending.wait().div_(self.axis.size)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
