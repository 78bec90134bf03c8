"""Profiler traces on request: ``train.profile_start``, ``train.profile_steps``, ``train.profile_ranks``.

Built on ``torch.profiler``; gridshard adds only what it alone knows: when to start and stop, where
to write, and the names of its own ranges. The trace of steps s … s + n − 1 (1-based, ``profile_start``
s, ``profile_steps`` n) of each recording rank (``profile_ranks``: a list, or ``all``, the default) is written to
``RUN_DIR/profile/rank{R}.trace.json``, Chrome trace JSON (Perfetto, ``chrome://tracing``). The
profiler records CPU activity, and on CUDA also the kernels.

gridshard's own ranges in the trace (``torch.profiler.record_function``), only while a trace
is recording (:class:`Ranges` is off otherwise, so a run without profiling pays one attribute
read per range and no profiler call):

* ``gridshard.forward`` and ``gridshard.backward``, one of each per micro-batch (the pipeline
  schedule's own ``Forward i`` / ``Backward i`` ranges take their place at P > 1);
* ``gridshard.grad_reduce``: the data-parallel reduction after the backward (ZeRO's ``sync()``);
* ``gridshard.optimizer``: gradient clipping, the optimizer step and ZeRO's gathers after it;
* every collective the ledger records, as ``gridshard.{op} {axis} {bytes} B`` (the ledger's
  payload convention, :mod:`gridshard.comm.ledger`), and the wait of an asynchronous one as
  ``gridshard.wait {op} {axis}``;
* ``gridshard.checkpoint``: a checkpoint save in the profiled steps;
* ``gridshard.gc``: the garbage collection after every ``train.gc_interval``-th step
  (:mod:`gridshard.engine.gc_control`);
* ``gridshard.log``: a log step's metrics (one all-gather of every rank's figures, evaluation
  when due), and ``gridshard.stop_check``: the all-reduce that agrees on a stop request.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import torch

from ..errors import ConfigError
from ..torch_private import dump_memory_snapshot, record_memory_history


class Ranges:
    """gridshard's named profiler ranges (module docstring), recorded only while ``on``. Whether or not
    a trace records, they also remember where this rank is, for a collective timeout's message
    (:mod:`gridshard.engine.hang`): ``step`` (1-based, set by the trainer), ``phase`` (the last range
    entered) and ``micro_batch`` (its micro-batch, where the driver knows it)."""

    def __init__(self):
        self.on = False
        self.step: Optional[int] = None
        self.phase: Optional[str] = None
        self.micro_batch: Optional[int] = None
        self.times: Optional[dict] = None          # {name: seconds} while timed (gridshard emulate)

    def __call__(self, name: str, micro_batch: Optional[int] = None):
        """A ``record_function`` range named ``name`` while a trace records, else a no-op context; with
        ``times`` set, each range's wall seconds are added to ``times[name]`` instead."""
        self.phase, self.micro_batch = name, micro_batch
        if self.times is not None:
            return self._timed(name)
        return torch.profiler.record_function(name) if self.on else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def where(self) -> dict:
        """This rank's step, phase and micro-batch (0-based), as last set."""
        return {"step": self.step, "phase": self.phase, "micro_batch": self.micro_batch}


class StepProfiler:
    """Starts ``torch.profiler`` before the first profiled step and writes the trace after the last
    (module docstring); does nothing on a rank that does not record or when ``train.profile_start``
    is null. ``ranges``: the job's :class:`Ranges` (also read by its ledger for the collectives).

    ``train.profile_memory`` (CUDA): the caching allocator's history is recorded from the start
    (:func:`gridshard.torch_private.record_memory_history`; it keeps each allocation's stack, which
    slows allocation) and written as ``RUN_DIR/profile/rank{R}.memory.pickle`` when the profiled steps
    end, and as ``rank{R}.oom.memory.pickle`` when the run runs out of memory (:meth:`out_of_memory`).
    Both open at pytorch.org/memory_viz; gridshard only writes them."""

    def __init__(self, train, rank: int, run_dir: Optional[str], device: torch.device, ranges: Ranges):
        start = train.profile_start
        self.ranges, self.device = ranges, device
        self.first = start
        self.last = None if start is None else start + train.profile_steps - 1
        chosen = train.profile_ranks in (None, "all") or rank in train.profile_ranks
        self.records = start is not None and chosen
        self.memory = bool(train.profile_memory) and chosen and device.type == "cuda"
        if (self.records or self.memory) and run_dir is None:
            raise ConfigError("train.profile_start or train.profile_memory is set but the run has no run directory to "
                              "write to. Fix: pass a run directory (gridshard train --run-dir DIR), or "
                              "train.profile_start=null and train.profile_memory=false.")
        folder = os.path.join(run_dir, "profile") if run_dir is not None else None
        self.path = os.path.join(folder, f"rank{rank}.trace.json") if self.records else None
        self.memory_paths = (os.path.join(folder, f"rank{rank}.memory.pickle"),
                             os.path.join(folder, f"rank{rank}.oom.memory.pickle")) if self.memory else None
        self._profiler = None
        self._snapshot_due = self.memory and start is not None
        if self.memory:
            self.memory = record_memory_history(True)

    def before_step(self, k: int) -> None:
        """Before 0-based step ``k``: start recording at the first profiled step."""
        if self.records and k + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
            self.ranges.on = True

    def after_step(self, k: int) -> None:
        """After 0-based step ``k``: at the last profiled step (or the run's last) write the trace and
        the memory snapshot."""
        if self.first is not None and k + 1 >= self.last:
            self.close()

    def close(self) -> None:
        """Stop a recording in progress and write its trace and memory snapshot (also when the run
        ended inside the profiled steps)."""
        if self._snapshot_due and self.memory:
            self._snapshot_due = False
            self._dump(self.memory_paths[0])
        if self._profiler is None:
            return
        self.ranges.on = False
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)

    def out_of_memory(self) -> Optional[str]:
        """The run ran out of device memory: write the history so far; its path, or None."""
        if not self.memory:
            return None
        self._dump(self.memory_paths[1])
        return self.memory_paths[1]

    def finish(self) -> None:
        """The run is over: :meth:`close`, then stop recording the memory history."""
        self.close()
        if self.memory:
            self.memory = False
            record_memory_history(False)

    def _dump(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dump_memory_snapshot(path)
