"""Data-parallel gradient averaging through gridshard's recorded all-reduce, in buckets.

After the last micro-batch of a step, each rank's local gradients are packed in order
into flat buffers of at most ``bucket_bytes`` (one dtype/device per bucket), each
buffer is summed over ``mesh.data`` with :func:`gridshard.comm.collectives.all_reduce`
(so the ledger records it), divided by D and copied back. Bytes per step are
:func:`gridshard.theory.training.dp_gradient_allreduce`.

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

    def __init__(self, params, data_axis, bucket_bytes: int = 25 << 20):
        self.params = [p for p in params if p.requires_grad]
        self.axis = data_axis
        self.buckets = []
        groups: dict = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, _), ps in groups.items():
            parts = bucket_partition([p.numel() for p in ps], torch.empty(0, dtype=dtype).element_size(),
                                     bucket_bytes)
            self.buckets += [[ps[i] for i in idx] for idx in parts]

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
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            flat = C.all_reduce(flat, self.axis).div_(self.axis.size)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
