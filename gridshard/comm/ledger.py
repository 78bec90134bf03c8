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
  (n−1)/n·B, broadcast and reduce (to one member) (n−1)/n·B (pipelined), all-to-all (n−1)/n·B (the
  rank's own block stays). This is the figure that sets the
  bandwidth term of the time; it is what the planner uses.
* ``seconds``: wall time spent inside the call (or waiting for an async call),
  only when timing is switched on (``LEDGER.timing = True``). On CUDA the timer
  synchronises the device, so leave timing off where speed matters more than
  the breakdown.

The ledger is public API: ``gridshard.LEDGER.summary()`` shows what a step moved.

Scope: one route. Every recorded call — the collectives of :mod:`gridshard.comm.collectives`
and the pipeline sends of :class:`gridshard.pipeline.meter.StageMeter` — goes through
:func:`record`, which writes to :func:`ledger_of` its axis: the axis's own ledger when its
mesh was built with one (``build_mesh(..., ledger=job_ledger)``: the trainer's meshes, so a
job never mixes its counts with another job's or a test's in the same process, and the
calls autograd runs on its own threads are recorded there too), else the *current* ledger:
the one installed by the innermost ``with use_ledger(ledger):`` on this thread/task (a
``contextvars`` variable), else a default ledger. ``LEDGER`` always means "the current
ledger". Entries are keyed by (op, mesh-axis name).

Pausing belongs to the route, not to one ledger: inside ``with ledger.paused():`` (any
ledger, ``LEDGER`` included) nothing issued on this thread/task is recorded, whichever
ledger it would go to — so ``gathered_state_dict`` on a trainer's mesh stays out of the
trainer's ledger, as its docstring says. ``ledger.enabled = False`` switches one ledger
off for good.

Blind spots: collectives issued by PyTorch components that do not go through
:mod:`gridshard.comm.collectives` (FSDP, ``torch.distributed.checkpoint``, DTensor
redistribution) cannot be counted. gridshard's own use of one, ``torch.distributed.checkpoint``,
runs on the checkpointer's own process group, outside the training step the ledger describes;
code that hands a step's work to such a component can say so with ``note_untracked(name)``,
and ``summary()`` then lists it as not recorded. The point-to-point sends of
``torch.distributed.pipelining`` schedules are recorded (op ``send``, axis ``pipeline``) by
:class:`gridshard.pipeline.meter.StageMeter`, which wraps the stage's send-op constructors.

Positions. Besides the totals, every call through :func:`record` — paused or not, counted or
not — numbers itself on its group: ``calls[(axis name, member ranks)]`` is how many calls this
rank has issued on that group, and ``last`` is the latest (:class:`CallPosition`; an async call's
``wait()`` makes it current again, waiting). Every member issues the same calls on a group in the
same order, so equal numbers mean the same collective; when one times out,
:mod:`gridshard.engine.hang` compares the members' numbers to name who did not arrive. Cost: a
dict update per call.
"""
from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


def ring_wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on a ring of ``group_size`` ranks (see module doc)."""
    n = group_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if op in ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"):
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
    last_bytes: int = 0               # the payload of the latest call (a profiler range's name)


@dataclass(frozen=True)
class CallPosition:
    """One call on a group: ``op`` on axis ``axis`` (members ``ranks``, global ranks), this rank's
    ``number``-th call on that group (1-based); ``waiting``: in the ``wait()`` of an async call."""

    op: str
    axis: str
    ranks: tuple
    number: int
    waiting: bool = False

    def row(self) -> dict:
        return {"op": self.op, "axis": self.axis, "ranks": list(self.ranks), "number": self.number,
                "waiting": self.waiting}


@dataclass
class CommLedger:
    """Accumulates collectives by (op, axis). See the module docstring for the fields. ``ranges``:
    the job's profiler ranges (:class:`gridshard.engine.profiling.Ranges`, or None): while they are
    on, each recorded collective is a named range of the trace."""

    enabled: bool = True
    timing: bool = False
    entries: dict = field(default_factory=dict)
    untracked: set = field(default_factory=set)
    ranges: Any = None
    calls: dict = field(default_factory=dict)       # {(axis name, member ranks): calls issued}: "Positions"
    last: Any = None                                # the latest CallPosition

    def enter(self, op: str, axis) -> CallPosition:
        """Number a call of ``op`` on ``axis``'s group and make it the latest ("Positions")."""
        key = (axis.name, axis.ranks)
        number = self.calls.get(key, 0) + 1
        self.calls[key] = number
        self.last = CallPosition(op, axis.name, axis.ranks, number)
        return self.last

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
        entry.last_bytes = int(payload_bytes)
        if self.recording:
            entry.count += 1
            entry.payload_bytes += int(payload_bytes)
            entry.wire_bytes += ring_wire_bytes(op, payload_bytes, group_size)
            entry.seconds += seconds
        return entry

    @contextmanager
    def timed(self, entry: LedgerEntry, device: torch.device):
        """Adds the wall time of the block to ``entry`` when timing is on."""
        if not (self.timing and self.recording):
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

    def by_axis(self, field_name: str = "payload_bytes") -> dict:
        """{axis: sum of ``field_name`` over that axis's entries} (e.g. payload bytes, seconds)."""
        out: dict = {}
        for (_, axis), entry in self.entries.items():
            out[axis] = out.get(axis, 0) + getattr(entry, field_name)
        return out

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

    @property
    def recording(self) -> bool:
        """Whether a call added now counts: this ledger is enabled and recording is not paused here."""
        return self.enabled and not _PAUSED.get()

    def paused(self):
        """Record nothing issued inside the block on this thread/task, in *any* ledger (e.g.
        metrics reductions, gathering a state dict): the pause of the one route, see the module
        docstring's "Scope"."""
        return recording_paused()


_DEFAULT = CommLedger()
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("gridshard_ledger", default=_DEFAULT)
_PAUSED: contextvars.ContextVar = contextvars.ContextVar("gridshard_ledger_paused", default=False)


@contextmanager
def recording_paused():
    """Inside the block no call is recorded on this thread/task, whichever ledger it would go to."""
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)


def ledger_of(axis) -> CommLedger:
    """Where calls on ``axis`` are recorded: its mesh's ledger, else the current
    one (the innermost :func:`use_ledger`, "Scope" in the module docstring)."""
    bound = getattr(axis, "ledger", None)
    return bound if bound is not None else _CURRENT.get()


def record(op: str, axis, payload_bytes: int, group_size: int | None = None) -> LedgerEntry:
    """The one route of every recorded call: ``op`` on ``axis`` (an :class:`gridshard.mesh.Axis`)
    moving ``payload_bytes`` in a group of ``group_size`` ranks (default ``axis.size``), added to
    :func:`ledger_of` the axis unless recording is paused. Returns the entry (async handles time
    their wait in it)."""
    ledger = ledger_of(axis)
    ledger.enter(op, axis)
    return ledger.add(op, axis.name, payload_bytes, axis.size if group_size is None else group_size)


@contextmanager
def use_ledger(ledger: CommLedger):
    """Write collectives issued inside the block to ``ledger``."""
    token = _CURRENT.set(ledger)
    try:
        yield ledger
    finally:
        _CURRENT.reset(token)


class _CurrentLedger:
    """``LEDGER``: every attribute is that of the current ledger (the innermost :func:`use_ledger`'s,
    else the default) at the time of use."""

    def __getattr__(self, name):
        return getattr(_CURRENT.get(), name)

    def __setattr__(self, name, value):
        setattr(_CURRENT.get(), name, value)

    def __repr__(self) -> str:
        return f"LEDGER -> {_CURRENT.get()!r}"


LEDGER = _CurrentLedger()
