"""What a pipeline stage measures about itself: busy time (→ bubble), micro-batches in
flight, saved activation bytes, and the bytes it sends to its neighbours.

``torch.distributed.pipelining`` runs a stage through three kinds of calls on the stage
object: ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
(compute, including this stage's tensor-parallel collectives) and the point-to-point sends and receives between them
(``get_fwd_send_ops`` / ``get_bwd_send_ops``). :meth:`StageMeter.attach` wraps those
calls *on the stage instance* (PyTorch's code is untouched; the wrappers only time and
count), which gives, per step:

* ``busy_s``: time in forward and backward, ``schedule_s``: wall time of the schedule's
  step; the **bubble share** is 1 − busy/schedule: the part of the pipelined forward and
  backward this rank waits for its neighbours (what the schedule's bubble formula predicts,
  (P−1)/(m+P−1) for GPipe and 1F1B at equal stage costs; the optimizer step, clipping and
  the data-parallel reduction after the schedule are not part of it);
* ``peak_in_flight``: the most micro-batches whose forward ran and backward did not yet —
  activation memory is proportional to it: ≤ P − stage for 1F1B, m for GPipe;
* ``peak_saved_bytes``: the most bytes the autograd graph held saved for backward
  (``saved_tensors_hooks``; parameters excluded), counted per micro-batch and released at
  its backward;
* sends: recorded in the job's ledger as ``send`` on the ``pipeline`` axis with their
  payload bytes (:func:`gridshard.theory.pipeline.boundary_bytes` per micro-batch).
"""
from __future__ import annotations

import time

import torch

from ..comm import ledger


class StageMeter:
    """Measures the stages of one rank; ``axis``: the pipeline axis the sends are recorded on
    (through :func:`gridshard.comm.ledger.record`, the route of every collective)."""

    def __init__(self, axis, params):
        self.axis = axis
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.reset()

    def reset(self) -> None:
        self.busy_s = 0.0
        self.schedule_s = 0.0                          # wall time inside the schedule's step
        self.in_flight = self.peak_in_flight = 0
        self.saved_bytes = self.peak_saved_bytes = 0
        self._chunk_bytes: dict = {}

    def attach(self, stage) -> None:
        fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        fsend, bsend = stage.get_fwd_send_ops, stage.get_bwd_send_ops
        index = stage.stage_index

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            seen, total = set(), [0]

            def pack(t):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self._param_ptrs and ptr not in seen:
                    seen.add(ptr)
                    total[0] += t.untyped_storage().nbytes()
                return t

            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fwd(fwd_chunk_id, *args, **kwargs)
            self.busy_s += time.perf_counter() - t0
            self._chunk_bytes[(index, fwd_chunk_id)] = total[0]
            self.saved_bytes += total[0]
            self.in_flight += 1
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return out

        def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            out = bwd(bwd_chunk_id, *args, **kwargs)
            self.busy_s += time.perf_counter() - t0
            self.saved_bytes -= self._chunk_bytes.pop((index, bwd_chunk_id), 0)
            self.in_flight -= 1
            return out

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):     # zero bubble's deferred pass
            t0 = time.perf_counter()
            out = bwd_w(bwd_chunk_id, *args, **kwargs)
            self.busy_s += time.perf_counter() - t0
            return out

        def record(ops):
            for op in ops:
                ledger.record("send", self.axis, op.tensor.numel() * op.tensor.element_size(), group_size=2)
            return ops

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        stage.get_fwd_send_ops = lambda chunk: record(fsend(chunk))
        stage.get_bwd_send_ops = lambda chunk: record(bsend(chunk))
