"""A worker that dies with the process that launched it.

``gridshard train`` (outside torchrun) is the parent of its workers: PyTorch's elastic agent runs
in the launcher's calling thread and starts them with the ``spawn`` start method, which forks and
execs them from that same thread (``torch.multiprocessing.spawn.start_processes`` starts spawn
children one by one, in the caller's thread; only ``forkserver`` with
``TORCH_MP_PARALLEL_START=1`` uses a thread pool, and gridshard does not use it). When the
launcher is killed with SIGKILL it cannot stop them: without more, they are re-parented to PID 1
(or a subreaper), never exit, and go on writing checkpoints and moving ``latest`` in a run
directory that a new run may already own.

:func:`die_with_parent` — called first thing in every worker of
:func:`gridshard.launch.launch_local` — ends that:

1. ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux): the kernel sends SIGKILL to this process when its
   parent *thread* exits. That thread is the one blocked in ``launch_local`` for the life of the
   workers (restarts included), so it exits only when the launcher dies. SIGKILL, not SIGTERM:
   an orphan must not run another line — no checkpoint, no metrics line — and nothing can catch it.
2. Then ``os.getppid()`` against the launcher's PID (passed down by the launcher): if the launcher
   died before the ``prctl`` (the worker spends a second or more importing torch first), the
   worker has been re-parented already and the death signal will never come; it kills itself.
3. A daemon watchdog thread, every ``WATCH_INTERVAL_S``, where the death signal is unavailable
   (not Linux, ``prctl`` refused) or the parent is not the launcher (some other process in
   between): it kills this process once its parent changes (re-parenting: the parent died) or the
   launcher's PID no longer exists.

Only the standard library is used (no torch, no gridshard import), so the module can be loaded and
tested in a bare interpreter.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

PR_SET_PDEATHSIG = 1               # <linux/prctl.h>
WATCH_INTERVAL_S = 0.5


def set_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # exists, owned by someone else
        return True
    return True


def _watch(launcher_pid: int, parent: int) -> None:
    while os.getppid() == parent and pid_alive(launcher_pid):
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(launcher_pid: int, use_prctl: bool = True) -> Optional[threading.Thread]:
    """Make this process end (SIGKILL) when the launcher ``launcher_pid`` ends (module docstring).
    Returns the watchdog thread when one was needed, else None. ``use_prctl=False`` forces the
    watchdog (for tests of the fallback)."""
    armed = use_prctl and set_death_signal(signal.SIGKILL)
    parent = os.getppid()                      # after the prctl: a launcher dying later is caught by it
    if parent != launcher_pid and not pid_alive(launcher_pid):
        os.kill(os.getpid(), signal.SIGKILL)   # the launcher died before the prctl: already an orphan
    if armed and parent == launcher_pid:
        return None
    thread = threading.Thread(target=_watch, args=(launcher_pid, parent), daemon=True,
                              name="gridshard-parent-watch")
    thread.start()
    return thread
