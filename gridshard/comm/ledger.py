"""The communication ledger: every collective gridshard issues is written here.

Each record is keyed by ``(op, axis)`` and accumulates

* ``count``: number of calls;
* ``payload_bytes``: bytes of the logical tensor the collective is about — for
  ``all_reduce`` and ``broadcast`` the tensor itself; for ``all_gather`` the full
  (gathered) output; for ``reduce_scatter`` the full (unscattered) input. With
  this convention Megatron's rule "sequence parallelism moves the same volume as
  the all-reduces it replaces" holds exactly: an all-reduce of B bytes and an
  all-gather + reduce-scatter of B bytes each count B.
* ``wire_bytes``: what one rank sends on a ring (bandwidth-optimal) algorithm
  for a group of n ranks: all-reduce 2(n−1)/n·B, all-gather and reduce-scatter
  (n−1)/n·B, broadcast and reduce (to one member) (n−1)/n·B (pipelined). This is the figure that sets the
  bandwidth term of the time; it is what the planner uses.
* ``seconds``: wall time spent inside the call (or waiting for an async call),
  only when timing is switched on (``LEDGER.timing = True``). On CUDA the timer
  synchronises the device, so leave timing off where speed matters more than
  the breakdown.

The ledger is public API: ``gridshard.LEDGER.summary()`` shows what a step moved.

Scope. Collectives are written to the *current* ledger: the one installed by the
innermost ``with use_ledger(ledger):`` on this thread/task (a ``contextvars`` variable),
else a default ledger. ``LEDGER`` always means "the current ledger", so a job (the
trainer owns one ``CommLedger`` and runs its steps under ``use_ledger``) never mixes its
counts with another job's or a test's in the same process. Entries are keyed by
(op, mesh-axis name).

Blind spots are said, not hidden: collectives issued by PyTorch components that do not go
through :mod:`gridshard.comm.collectives` (FSDP, ``torch.distributed.checkpoint``,
DTensor redistribution) cannot be counted; code that hands work to such a component calls
``note_untracked(name)`` and ``summary()`` lists them as not recorded. The point-to-point
sends of ``torch.distributed.pipelining`` schedules are recorded (op ``send``, axis
``pipeline``) by :class:`gridshard.pipeline.meter.StageMeter`, which wraps the stage's
send-op constructors.
"""
from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def ring_wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on a ring of ``group_size`` ranks (see module doc)."""
    n = group_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if op in ("all_gather", "reduce_scatter", "broadcast", "reduce"):
        return (n - 1) / n * payload_bytes
    return float(payload_bytes)


@dataclass
class LedgerEntry:
    """Totals of one (op, axis) pair."""

    op: str
    axis: str
    count: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class CommLedger:
    """Accumulates collectives by (op, axis). See the module docstring for the fields."""

    enabled: bool = True
    timing: bool = False
    entries: dict = field(default_factory=dict)
    untracked: set = field(default_factory=set)

    def reset(self) -> None:
        self.entries.clear()
        self.untracked.clear()

    def note_untracked(self, component: str) -> None:
        """Record that ``component`` issues collectives this ledger cannot see."""
        self.untracked.add(component)

    def add(self, op: str, axis: str, payload_bytes: int, group_size: int, seconds: float = 0.0) -> LedgerEntry:
        entry = self.entries.get((op, axis))
        if entry is None:
            entry = self.entries[(op, axis)] = LedgerEntry(op, axis)
            entry.owner = self                      # async handles time their wait in the same ledger
        if self.enabled:
            entry.count += 1
            entry.payload_bytes += int(payload_bytes)
            entry.wire_bytes += ring_wire_bytes(op, payload_bytes, group_size)
            entry.seconds += seconds
        return entry

    @contextmanager
    def timed(self, entry: LedgerEntry, device: torch.device):
        """Adds the wall time of the block to ``entry`` when timing is on."""
        if not (self.timing and self.enabled):
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            entry.seconds += time.perf_counter() - t0

    def total(self, field_name: str = "payload_bytes", op: str | None = None, axis: str | None = None):
        """Sum of ``field_name`` over entries, optionally filtered by op and/or axis."""
        return sum(getattr(e, field_name) for (o, a), e in self.entries.items()
                   if (op is None or o == op) and (axis is None or a == axis))

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        return self.total("count", op, axis)

    def payload_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        return self.total("payload_bytes", op, axis)

    def seconds(self) -> float:
        return self.total("seconds")

    def summary(self) -> str:
        """A small table of all entries, one line per (op, axis)."""
        lines = [f"{'op':<15}{'axis':<10}{'count':>7}{'payload MiB':>13}{'wire MiB':>11}{'seconds':>10}"]
        for (op, axis), e in sorted(self.entries.items()):
            lines.append(f"{op:<15}{axis:<10}{e.count:>7}{e.payload_bytes / 2**20:>13.3f}"
                         f"{e.wire_bytes / 2**20:>11.3f}{e.seconds:>10.4f}")
        if self.untracked:
            lines.append(f"not recorded (collectives of): {', '.join(sorted(self.untracked))}")
        return "\n".join(lines)

    @contextmanager
    def paused(self):
        """Do not record collectives issued inside the block (e.g. metrics reductions)."""
        prev = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = prev


_DEFAULT = CommLedger()
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("gridshard_ledger", default=_DEFAULT)


def current_ledger() -> CommLedger:
    """The ledger collectives are written to here (see "Scope" in the module docstring)."""
    return _CURRENT.get()


@contextmanager
def use_ledger(ledger: CommLedger):
    """Write collectives issued inside the block to ``ledger``."""
    token = _CURRENT.set(ledger)
    try:
        yield ledger
    finally:
        _CURRENT.reset(token)


class _CurrentLedger:
    """``LEDGER``: every attribute is that of :func:`current_ledger` at the time of use."""

    def __getattr__(self, name):
        return getattr(_CURRENT.get(), name)

    def __setattr__(self, name, value):
        setattr(_CURRENT.get(), name, value)

    def __repr__(self) -> str:
        return f"LEDGER -> {_CURRENT.get()!r}"


LEDGER = _CurrentLedger()
