"""Run a function on N gloo CPU ranks, reusing the worker processes across calls.

``run_on_ranks(n, fn, *args)`` pickles ``fn`` by reference (it must be a module
level function), runs ``fn(*args)`` on each of n ranks of a live process group,
and returns the list of per-rank return values. Workers of a given size are
started once (forked from a fork server that imported torch and gridshard) and kept for later
calls; after each call a worker collects the call's garbage and freezes what is left
(``gc.freeze``), so the next collection scans only what the next call makes.

Failure handling:

* an exception on any rank raises :class:`RankFailure` with that rank's traceback;
* ranks that have not answered ``grace_s`` seconds after a failure, or when the
  overall ``timeout`` passes, are treated as stuck: each one dumps all its thread
  stacks (``faulthandler`` on SIGUSR1) and the stacks go into the error, together
  with the tracebacks of the ranks that failed before, so a deadlock fails within a
  bounded time and shows both why one rank stopped and where each other rank waits;
* a worker that dies (segfault, OOM kill) is reported with its exit code;
* after any failure the worker group is torn down and rebuilt on the next call,
  since its collectives may be out of step.

Before each call every worker resets the communication ledger, its timing flag
and the RNG seed (``torch.manual_seed(1234 + rank)``), so calls are independent.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler

from ..netutil import free_port

# The test harness's pool of live worker groups, one per world size: the one process-wide
# mutable state gridshard keeps, on purpose (a group's start and warm-up outlive a call). Keyed by world
# size, bounded by the sizes tests use; a failed group is removed and rebuilt on the next call,
# and shutdown_all() (at exit) closes them all.
_GROUPS: dict = {}
# Live workers kept at most (idle ones hold 0.3-1 GiB each): starting a group that would exceed it
# first closes the groups used least recently, so a wide run touching every size stays in memory.
MAX_LIVE_WORKERS = 32      # the sizes most tests use, 1 + 2 + 4 + 8 + 16, stay
# A group whose workers had more threads than this after a call is replaced before the next one: a
# backstop for groups that outlive a call (each gloo group keeps 3 threads, one of which wakes), should
# something hold one beyond the reach of _release_process_groups (a call's own processes are never
# replaced under it: test_rank_timing's pids).
MAX_WORKER_THREADS = 100


# Workers are forked from multiprocessing's fork server, which imports these once: a spawned worker
# imported them itself (~4 s of CPU a worker: 27 s to start 16 on 2 cores, 3 s now, 0.1 s once the
# server runs). The server only imports and forks; torch's import leaves one idle native thread,
# as in every process that forks DataLoader workers. transformers is left out (its import starts
# another thread): the workers that use it import it themselves.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "gridshard.engine", "gridshard.testing.multiprocess"]


class RankFailure(AssertionError):
    """One or more ranks failed, died or got stuck."""


def _worker_main(rank, world_size, port, sys_path, environ, task_q, result_q, stack_file):
    import faulthandler

    sys.path[:] = sys_path
    os.environ.clear()                   # the parent's environment now, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    fh = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    from gridshard.comm.ledger import LEDGER

    gc.freeze()                          # the imported modules: out of every later collection
    result_q.put((rank, "ready", None))
    while True:
        item = task_q.get()
        if item is None:
            break
        call_id, fn, args, kwargs = item
        LEDGER.reset()
        LEDGER.enabled, LEDGER.timing = True, False
        torch.manual_seed(1234 + rank)
        try:
            out = fn(*args, **kwargs)
            # the queue pickles in a feeder thread, where a failure is only printed and the
            # parent would wait for its timeout: pickle here so the error is reported
            ForkingPickler.dumps(out)
            _release_process_groups()
            gc.freeze()                  # what outlived the call (modules it imported, memos) as well
            result_q.put((rank, "ok", (call_id, (out, _thread_count()))))
        except BaseException:  # noqa: BLE001 - report everything, the parent decides
            result_q.put((rank, "error", (call_id, traceback.format_exc())))
    # Leave without the interpreter's teardown once the last result is flushed: freeing torch's
    # modules took ~2 s a 4-rank group on 2 cores (a session's end closes up to 32 workers, and so
    # does every eviction), against 0.08 s now. The exit functions still run (multiprocessing's
    # among them: they release the semaphore tqdm's lock registered); nothing else is left to save.
    result_q.close()
    result_q.join_thread()
    fh.close()
    atexit._run_exitfuncs()
    os._exit(0)


def _thread_count() -> int:
    """This process's threads, native ones included (0 where ``/proc`` is missing)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return 0


def _release_process_groups() -> None:
    """Destroy every process group the call created (all but the default one) and forget the
    layout memos holding some of them (:func:`gridshard.mesh.layout_mesh`,
    :func:`gridshard.tensor.tp3d.mesh.layout_mesh_3d`); every rank does so after its call.

    Why: a gloo group keeps a socket loop thread that wakes about 20 times a second, and two worker
    threads. Workers that kept every earlier call's groups held about 60 each, and a wide run's idle
    pools woke tens of thousands of times a second on 2 cores (65 % of the CPU in the kernel,
    the running test starved). The collector runs last: a trained model sits in reference cycles
    (its hooks' closures and the gradient reduction's bound methods refer back to it), and with
    it the groups its reduction holds, whose threads stayed alive until Python's cyclic collector
    happened to run (measured on a 2-rank worker after each of three 1D training calls: 14, 20 and
    26 threads without it, two more gloo groups per call; 8 each time with it)."""
    from ..mesh import layout_mesh
    from ..tensor.tp3d.mesh import layout_mesh_3d
    from ..torch_private import live_subgroups
    import torch.distributed as dist

    layout_mesh.cache_clear()
    layout_mesh_3d.cache_clear()
    for group in live_subgroups():
        dist.destroy_process_group(group)
    gc.collect()


class WorkerGroup:
    """``world_size`` worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, start_timeout: float = 120.0):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)     # read once, when the server starts
        self.world_size = world_size
        self.port = free_port()
        self.result_q = ctx.Queue()
        self.task_qs = [ctx.Queue() for _ in range(world_size)]
        self.tmpdir = tempfile.mkdtemp(prefix=f"gridshard-w{world_size}-")
        self.stack_files = [os.path.join(self.tmpdir, f"rank{r}.stack") for r in range(world_size)]
        self.procs = []
        self._calls = 0
        self.threads = 0                    # the most threads a worker had after the last call
        for r in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, world_size, self.port, list(sys.path), dict(os.environ), self.task_qs[r],
                                  self.result_q, self.stack_files[r]))
            p.start()
            self.procs.append(p)
        ready = set()
        deadline = time.monotonic() + start_timeout
        while len(ready) < world_size:
            rank, kind, _ = self._get(deadline, "start-up", ready)
            ready.add(rank)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _get(self, deadline, what, answered, errors=None):
        """The next worker message; on a dead or stuck rank fail with the tracebacks already
        collected in ``errors`` (rank -> traceback) as well as the stuck ranks' stacks."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self.result_q.get(timeout=0.2)
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in answered]
            if dead:
                codes = {r: self.procs[r].exitcode for r in dead}
                self._fail(f"rank(s) {dead} died during {what} with exit codes {codes}", answered, errors)
            if time.monotonic() > deadline:
                self._fail(f"timeout during {what}: rank(s) {sorted(set(range(self.world_size)) - set(answered))} "
                           f"did not answer (deadlock or too slow)"
                           + (f"; rank(s) {sorted(errors)} had failed before" if errors else ""), answered, errors)

    def _stacks(self, ranks) -> str:
        for r in ranks:
            if self.procs[r].is_alive():
                with contextlib.suppress(OSError):
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for r in ranks:
            try:
                with open(self.stack_files[r]) as f:
                    text = f.read()
            except OSError:
                text = "(no stack)"
            parts.append(f"--- stack of rank {r} ---\n{text[-6000:]}")
        return "\n".join(parts)

    def _fail(self, message, answered, errors=None):
        stuck = [r for r in range(self.world_size) if r not in answered]
        details = ""
        if errors:
            details += "\n".join(f"--- traceback of rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if stuck:
            details += "\n" + self._stacks(stuck)
        self.close(force=True)
        raise RankFailure(f"{message}\n{details}")

    def run(self, fn, *args, timeout: float = 120.0, grace_s: float = 10.0, **kwargs):
        if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
            raise TypeError(f"run_on_ranks needs a module-level function importable by workers, got {fn!r}")
        self._calls += 1
        call_id = self._calls
        try:  # Queue.put pickles in a background thread that only prints a failure
            ForkingPickler.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"run_on_ranks: cannot pickle the function or its arguments for the workers: "
                            f"{type(e).__name__}: {e}") from e
        for q in self.task_qs:
            q.put((call_id, fn, args, kwargs))
        results, threads, errors, answered = {}, {}, {}, set()
        first_error_at = None
        deadline = time.monotonic() + timeout
        while len(answered) < self.world_size:
            if errors:
                deadline = min(deadline, first_error_at + grace_s)
            rank, kind, payload = self._get(deadline, f"{fn.__qualname__}", answered, errors)
            cid, value = payload
            if cid != call_id:
                continue
            answered.add(rank)
            if kind == "ok":
                results[rank], threads[rank] = value
            else:
                if not errors:
                    first_error_at = time.monotonic()
                errors[rank] = value
        if errors:
            self._fail(f"{fn.__qualname__} failed on rank(s) {sorted(errors)} of {self.world_size}", answered, errors)
        self.threads = max(threads.values())
        return [results[r] for r in range(self.world_size)]

    def request_stop(self):
        """Ask every worker to leave its loop (they exit on their own; :meth:`close` waits)."""
        for q in self.task_qs:
            with contextlib.suppress(Exception):
                q.put(None)

    def close(self, force: bool = False):
        self.request_stop()
        for p in self.procs:
            p.join(timeout=0.5 if force else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.tmpdir, ignore_errors=True)   # the stack files: read by _fail before it closes
        _GROUPS.pop(self.world_size, None) if _GROUPS.get(self.world_size) is self else None


def run_on_ranks(world_size: int, fn, *args, timeout: float = 120.0, fresh: bool = False, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return per-rank results.
    ``fresh``: on new worker processes (e.g. to measure a peak RSS that no earlier test raised);
    otherwise on the live group of that size unless it died or holds too many threads
    (:data:`MAX_WORKER_THREADS`)."""
    group = _GROUPS.pop(world_size, None)
    if group is None or not group.alive() or fresh or group.threads > MAX_WORKER_THREADS:
        if group is not None:
            group.close(force=True)
        _make_room(world_size)
        group = WorkerGroup(world_size)
    _GROUPS[world_size] = group                  # last in the dict: the most recently used
    return group.run(fn, *args, timeout=timeout, **kwargs)


def _make_room(world_size: int) -> None:
    """Close the least recently used groups until ``world_size`` more workers fit in
    :data:`MAX_LIVE_WORKERS` (a group larger than that on its own still starts)."""
    while _GROUPS and sum(_GROUPS) + world_size > MAX_LIVE_WORKERS:
        next(iter(_GROUPS.values())).close()


def shutdown_all():
    """Stop every worker group: all are asked first, so they wind down together."""
    for g in list(_GROUPS.values()):
        g.request_stop()
    for g in list(_GROUPS.values()):
        g.close()
    _GROUPS.clear()


atexit.register(shutdown_all)
