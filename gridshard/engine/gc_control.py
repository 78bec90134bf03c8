"""Python's cyclic garbage collector during a training run (``train.gc_interval``).

Python runs its cyclic collector when the count of container allocations crosses a threshold: on
each rank at its own moment. A full collection walks every tracked object of a process that
imported torch (measured on this 2-core machine: 160 ms over the 315,000 objects of a rank that
trained the tiny model; a collection of generations 0 and 1 right after it, under 0.1 ms), and a
rank inside one when its peers reach a collective makes them all wait: a straggler that moves from
rank to rank and step to step. Megatron-LM (``--manual-gc``,
``--manual-gc-interval``) and torchtitan (``training.gc_freq``) therefore switch automatic
collection off for the run and collect at the same step on every rank; gridshard does so too.

With ``gc_interval`` k > 0: automatic collection off when the run starts, after one full
collection then, and a collection of generations 0 and 1 after every k-th step on every rank
(what a step leaves in reference cycles is young; the long-lived objects are not walked again).
The full collection at the start frees what earlier work in the process left in reference cycles:
a model and its gradient reduction refer to each other (``model.grad_reducer``, the reduction's
hooks on the parameters), so a ``Trainer`` dropped before this one, its parameters, optimizer
states and process groups, waits for a full collection, which automatic collection being off would
otherwise put off until the run ends. When the run ends, normally or not, automatic collection is
switched back on if it was on before. k = 0 leaves Python's collector alone.

The step itself leaves no tensor in a reference cycle (measured with ``gc.DEBUG_SAVEALL`` over
three steps at 1D + SP with ZeRO-1, 2D, 3D, C = 2 and full recompute: no tensor among the
collected objects; full recompute leaves 84 small objects a step, from torch's pytree flattening
under ``torch.utils.checkpoint``), so switching the collector off holds no activation memory.
"""
from __future__ import annotations

import gc


class StepCollector:
    """The collector's policy for one run: :meth:`start` before the first step, :meth:`due` /
    :meth:`collect` after each, :meth:`stop` when the run ends (always)."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = None                       # gc.isenabled() at start; None: not started

    def start(self) -> None:
        if self.interval and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def due(self, step: int) -> bool:
        """Whether a collection follows ``step`` (1-based; the same answer on every rank)."""
        return bool(self.interval) and self._was_enabled is not None and step % self.interval == 0

    def collect(self) -> int:
        """Collect generations 0 and 1; returns the unreachable objects found."""
        return gc.collect(1)

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
