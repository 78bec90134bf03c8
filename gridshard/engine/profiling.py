"""Profiler traces on request: ``train.profile_start``, ``train.profile_steps``, ``train.profile_ranks``.

Built on ``torch.profiler``; gridshard adds only what it alone knows: when to start and stop, where
to write, and the names of its own ranges. The trace of steps s … s + n − 1 (1-based, ``profile_start``
s, ``profile_steps`` n) of each recording rank (``profile_ranks``, default every rank) is written to
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
* ``gridshard.checkpoint``: a checkpoint save in the profiled steps.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from ..errors import ConfigError


class Ranges:
    """gridshard's named profiler ranges (module docstring), recorded only while ``on``."""

    def __init__(self):
        self.on = False

    def __call__(self, name: str):
        """A ``record_function`` range named ``name`` while a trace records, else a no-op context."""
        return torch.profiler.record_function(name) if self.on else contextlib.nullcontext()


class StepProfiler:
    """Starts ``torch.profiler`` before the first profiled step and writes the trace after the last
    (module docstring); does nothing on a rank that does not record or when ``train.profile_start``
    is null. ``ranges``: the job's :class:`Ranges` (also read by its ledger for the collectives)."""

    def __init__(self, train, rank: int, run_dir: Optional[str], device: torch.device, ranges: Ranges):
        start = train.profile_start
        self.ranges, self.device = ranges, device
        self.first = start
        self.last = None if start is None else start + train.profile_steps - 1
        self.records = start is not None and (train.profile_ranks is None or rank in train.profile_ranks)
        if self.records and run_dir is None:
            raise ConfigError("train.profile_start is set but the run has no run directory to write the traces to. "
                              "Fix: pass a run directory (gridshard train --run-dir DIR), or train.profile_start=null.")
        self.path = os.path.join(run_dir, "profile", f"rank{rank}.trace.json") if self.records else None
        self._profiler = None

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
        """After 0-based step ``k``: stop at the last profiled step (or the run's last) and write the trace."""
        if self._profiler is not None and k + 1 >= self.last:
            self.close()

    def close(self) -> None:
        """Stop a recording in progress and write its trace (the run ended inside the profiled steps)."""
        if self._profiler is None:
            return
        self.ranges.on = False
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)
