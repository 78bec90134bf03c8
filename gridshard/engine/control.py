"""Stopping a run on request, and telling a stalled rank from a live one.

Stop on request (Ctrl-C). A worker that calls :func:`install_stop_handler` turns its first
SIGINT into a request: :meth:`gridshard.engine.trainer.Trainer.run` finishes the current
step, all ranks agree on the step to stop at (one all-reduce of a one-element flag at every
step end, MAX over the world: a signal reaches the ranks at slightly different times), the
step is logged, a checkpoint of the completed steps is written (blocking) when the run has a
run directory, and :class:`TrainingStopped` is raised on every rank. Further SIGINTs are
ignored by the worker (one Ctrl-C in a terminal reaches a worker twice: from the terminal
and forwarded by the launcher); the launcher (``gridshard train``) answers a second Ctrl-C
by killing the workers at once. SIGTERM still ends a worker at once: it is also how
PyTorch's elastic agent stops the surviving workers after a failure.

Heartbeats. :class:`Heartbeat` rewrites ``RUN_DIR/logs/heartbeat_rank_N`` (``<unix time>
<pid> <host>``) every second from a daemon thread. A rank blocked in a collective keeps
beating (the wait releases the GIL); a stopped (SIGSTOP), hung-in-Python or swapped-out rank
does not. The local launcher's :class:`StallWatchdog` kills a worker silent for longer than
``train.collective_timeout_s`` (+ 2 s), and when the job fails the ranks it killed — else
those :func:`stalled_ranks` finds, whose last beat is much older than the newest one — are
named as the ranks the others were waiting for.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from typing import Optional

from .. import _stop

EXIT_INTERRUPTED = 130
HEARTBEAT_INTERVAL_S = 1.0

class TrainingStopped(Exception):
    """Raised by ``Trainer.run`` on every rank after a stop request: ``step`` optimizer steps are
    complete; ``checkpoint`` is the folder holding them (None without a run directory)."""

    def __init__(self, step: int, checkpoint: Optional[str], losses: list):
        super().__init__(f"stopped at step {step}")
        self.step, self.checkpoint, self.losses = step, checkpoint, losses


def install_stop_handler() -> None:
    """SIGINT → stop at the end of the current step (all ranks must call this, or none). A
    SIGINT that arrived earlier in a launched worker (``gridshard/_stop.py``) is kept."""
    _stop.install()


def stop_installed() -> bool:
    return _stop.state["installed"]


def stop_requested() -> bool:
    return _stop.state["requested"]


# ---- heartbeats ----------------------------------------------------------------------------
def heartbeat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"heartbeat_rank_{rank}")


class Heartbeat:
    """A daemon thread rewriting this rank's heartbeat file every ``interval`` seconds."""

    def __init__(self, run_dir: str, rank: int, interval: float = HEARTBEAT_INTERVAL_S):
        self.path, self.interval = heartbeat_path(run_dir, rank), interval
        self.line = f"{os.getpid()} {socket.gethostname()}"
        self._done = threading.Event()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gridshard-heartbeat")
        self._thread.start()

    def beat(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{time.time():.3f} {self.line}\n")
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            # a full disk (or the run directory went away): try again; stopping would read as a stall
            with contextlib.suppress(OSError):
                self.beat()

    def stop(self) -> None:
        self._done.set()


def read_heartbeats(run_dir: str, world: int) -> dict:
    """{rank: (unix time, pid, host)} of ranks 0..world-1 that have a heartbeat file."""
    beats = {}
    for rank in range(world):
        try:
            with open(heartbeat_path(run_dir, rank)) as f:
                stamp, pid, host = f.read().split()[:3]
            beats[rank] = (float(stamp), int(pid), host)
        except (OSError, ValueError):
            continue
    return beats


def stalled_ranks(run_dir: str, world: int, timeout_s: float) -> list:
    """[(rank, seconds its heartbeats stopped before the newest one)] for ranks silent for more
    than max(3 s, timeout_s / 2) at the end of the job: a rank the others waited for. A rank
    that died leaves no such gap (the others fail at once on the closed connection); nor do
    live ranks, which beat until they exit."""
    beats = read_heartbeats(run_dir, world)
    if len(beats) < 2:
        return []
    newest = max(t for t, _, _ in beats.values())
    gap = max(3.0, 0.5 * timeout_s)
    return [(r, newest - t) for r, (t, _, _) in sorted(beats.items()) if newest - t > gap]


class StallWatchdog:
    """In the local launcher: every second, kill (SIGKILL) a worker of this process whose
    heartbeat is older than ``timeout_s`` (``train.collective_timeout_s``) plus 2 s — by then
    its peers have given up on it in a collective, and a stopped (SIGSTOP) process would
    otherwise hold the job until the elastic agent's 30 s shutdown wait ends. ``killed``:
    [(rank, silent seconds)]."""

    def __init__(self, run_dir: str, world: int, timeout_s: float):
        self.run_dir, self.world, self.limit = run_dir, world, timeout_s + 2.0
        self.killed: list = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gridshard-stall-watchdog")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        return False

    def _loop(self) -> None:
        while not self._done.wait(HEARTBEAT_INTERVAL_S):
            now = time.time()
            for rank, (stamp, pid, host) in read_heartbeats(self.run_dir, self.world).items():
                silent = now - stamp
                if silent > self.limit and host == socket.gethostname() and _is_child(pid) and \
                        rank not in dict(self.killed):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append((rank, silent))


def _is_child(pid: int) -> bool:
    """Whether ``pid`` is a live child of this process (not a dead attempt's reused pid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["PPid"]) == os.getpid() and not fields["State"].strip().startswith("Z")
    except (OSError, KeyError, ValueError):
        return False


def clear_heartbeats(run_dir: str) -> None:
    """Remove earlier attempts' heartbeat files (a previous run in this directory)."""
    folder = os.path.join(run_dir, "logs")
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("heartbeat_rank_"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
