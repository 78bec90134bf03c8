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
  the data-parallel reduction after the schedule are not part of it). Both are measured on
  the device's clock by a :class:`RegionTimer`: host time on the CPU, CUDA events on the
  current stream on a GPU (where host time would measure kernel launches, not kernels);
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
from contextlib import contextmanager

import torch

from ..comm import ledger
from ..nn.saved import as_saved


class RegionTimer:
    """The summed duration of timed regions (``with timer.region(): ...``) on ``device``'s clock.

    * CPU: ``time.perf_counter`` around each region (the host runs the work).
    * CUDA: kernels run after the host launched them, so host time would measure launches. A
      pair of CUDA events (``enable_timing``) is recorded on the current stream around each
      region, and a pair is read (``elapsed_time``) only once its end event has completed:
      at each region's end the completed pairs in front are folded in (``Event.query()``, which
      does not wait; events of one stream complete in order), the rest when :attr:`total_s` is
      read. The trainer reads it at log steps, after its one sync point (the loss read), so the
      read waits for nothing and no region adds a host sync. Pending pairs: at most the
      regions of one log interval."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._done_s = 0.0
        self._pending: list = []                       # CUDA: (start, end) events not yet read

    @contextmanager
    def region(self):
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._done_s += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((start, end))
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Add the pairs in front whose end event completed (all of them with ``wait``)."""
        done = 0
        for start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                break
            self._done_s += start.elapsed_time(end) / 1e3          # milliseconds → seconds
            done += 1
        del self._pending[:done]

    @property
    def total_s(self) -> float:
        """Seconds in the regions so far (CUDA: waits for the last region's end event, done by
        the time the trainer's sync point passed)."""
        self._fold(wait=True)
        return self._done_s


class StageMeter:
    """Measures the stages of one rank; ``axis``: the pipeline axis the sends are recorded on
    (through :func:`gridshard.comm.ledger.record`, the route of every collective); ``device``:
    the stages' device, whose clock times them (:class:`RegionTimer`)."""

    def __init__(self, axis, params, device="cpu"):
        self.axis, self.device = axis, device
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.reset()

    def reset(self) -> None:
        self.busy = RegionTimer(self.device)           # stage forward and backward calls
        self.schedule = RegionTimer(self.device)       # the schedule's step (runner.PipelineRunner.run)
        self.in_flight = self.peak_in_flight = 0
        self.saved_bytes = self.peak_saved_bytes = 0
        self._chunk_bytes: dict = {}

    @property
    def busy_s(self) -> float:
        return self.busy.total_s

    @property
    def schedule_s(self) -> float:
        return self.schedule.total_s

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
                return as_saved(t)

            with self.busy.region(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fwd(fwd_chunk_id, *args, **kwargs)
            self._chunk_bytes[(index, fwd_chunk_id)] = total[0]
            self.saved_bytes += total[0]
            self.in_flight += 1
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return out

        def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
            with self.busy.region():
                out = bwd(bwd_chunk_id, *args, **kwargs)
            self.saved_bytes -= self._chunk_bytes.pop((index, bwd_chunk_id), 0)
            self.in_flight -= 1
            return out

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):     # zero bubble's deferred pass
            with self.busy.region():
                return bwd_w(bwd_chunk_id, *args, **kwargs)

        def record(ops):
            for op in ops:
                ledger.record("send", self.axis, op.tensor.numel() * op.tensor.element_size(), group_size=2)
            return ops

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        stage.get_fwd_send_ops = lambda chunk: record(fsend(chunk))
        stage.get_bwd_send_ops = lambda chunk: record(bsend(chunk))
