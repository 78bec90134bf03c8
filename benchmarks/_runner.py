"""Shared machinery of the tensor-parallel benchmarks: fresh local gloo ranks, step timing,
collective counting for PyTorch's own DTensor, and a plain-text table.

API (all a benchmark needs)
---------------------------

``run_on_fresh_ranks(n, fn, *args, **kwargs) -> list``
    Start ``n`` *new* processes (``spawn``), join them in one gloo process group on
    127.0.0.1, set ``torch.set_num_threads(threads)`` (default 1) and seed
    ``torch.manual_seed(seed)`` (the SAME seed on every rank, so every rank draws the same
    global inputs and weights), call ``fn(*args, **kwargs)`` on every rank, return the
    per-rank results (index = global rank) and tear the processes down. ``fn`` must be a
    module-level function (defined in an importable module, or in the benchmark script
    itself when run as ``python benchmarks/x.py``: spawn re-imports the script as the
    children's ``__main__``). A failing rank raises :class:`BenchmarkFailure` with its
    traceback; ranks that do not finish within ``timeout`` seconds are killed.

``run_rank0(n, fn, *args, **kwargs)``
    Same, returns only rank 0's result.

``time_steps(step, warmup, iters) -> list[float]``
    Inside ``fn``: run ``step()`` ``warmup`` times, then ``iters`` timed times; each timed
    step starts right after a barrier of the default group, so the i-th entries of all
    ranks' lists measure the same step. The step time of the job is the *max over ranks*
    of entry i: :func:`step_times_of_job` does it on the per-rank lists.

``CollectiveCounter``
    A ``TorchDispatchMode`` that counts the functional collectives DTensor issues
    (``torch.ops._c10d_functional.*``), forward and backward, with the payload convention
    of :mod:`gridshard.comm.ledger`: all-reduce = the tensor, all-gather = the gathered
    output (= input × group size), reduce-scatter = the unscattered input, all-to-all =
    the input. Use it around one extra untimed step (a dispatch mode costs time).

``format_table(headers, rows) -> str``, ``median(xs)``.

Why fresh processes: every variant starts from the same state (no warm caches, no
process groups or allocator state left by another variant), and a hang or crash in one
variant cannot poison the next one.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
from typing import Callable, Sequence

__all__ = ["run_on_fresh_ranks", "run_rank0", "time_steps", "step_times_of_job", "CollectiveCounter",
           "tensor_to_bytes", "tensor_from_bytes",
           "format_table", "median", "BenchmarkFailure"]


class BenchmarkFailure(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _rank_main(rank, world_size, port, threads, seed, sys_path, fn, args, kwargs, result_q):
    sys.path[:] = sys_path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        torch.manual_seed(seed)
        out = fn(*args, **kwargs)
        result_q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result_q.put((rank, "error", traceback.format_exc()))
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - results are already delivered
        pass


def run_on_fresh_ranks(world_size: int, fn: Callable, *args, timeout: float = 1800.0, threads: int = 1,
                       seed: int = 0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh gloo ranks; per-rank results."""
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    from gridshard.netutil import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, threads, seed, list(sys.path), fn, args, kwargs, result_q))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, kind, value = result_q.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in results and r not in errors]
                if dead:
                    # a rank may have put its answer just before exiting: drain once more
                    try:
                        rank, kind, value = result_q.get(timeout=2.0)
                    except queue.Empty:
                        raise BenchmarkFailure(f"{fn.__qualname__}: rank(s) {dead} died with exit codes "
                                               f"{[procs[r].exitcode for r in dead]}") from None
                elif errors or time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results) - set(errors))
                    why = "another rank failed" if errors else f"timeout after {timeout:.0f} s"
                    raise BenchmarkFailure(f"{fn.__qualname__}: rank(s) {missing} did not finish ({why})\n"
                                           + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items()))
                else:
                    continue
            (results if kind == "ok" else errors)[rank] = value
        if errors:
            raise BenchmarkFailure(f"{fn.__qualname__} failed on rank(s) {sorted(errors)}\n"
                                   + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def run_rank0(world_size: int, fn: Callable, *args, **kwargs):
    """:func:`run_on_fresh_ranks` and keep rank 0's result."""
    return run_on_fresh_ranks(world_size, fn, *args, **kwargs)[0]


def time_steps(step: Callable[[], None], warmup: int, iters: int) -> list:
    """This rank's wall time of ``iters`` calls of ``step`` after ``warmup`` untimed ones.
    Every timed call starts right after a barrier of the default process group."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def step_times_of_job(per_rank_times: Sequence[Sequence[float]]) -> list:
    """Step i of the job takes as long as its slowest rank: elementwise max over ranks."""
    return [max(ts) for ts in zip(*per_rank_times)]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _collective_counter_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    funcol = torch.ops._c10d_functional

    def _bytes(t) -> int:
        return t.numel() * t.element_size()

    def _tensors(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for t in x if isinstance(t, torch.Tensor)]
        return []

    # op → (ledger name, payload bytes from (args, kwargs))
    rules = {
        funcol.all_reduce.default: ("all_reduce", lambda a, k: _bytes(a[0])),
        funcol.all_reduce_.default: ("all_reduce", lambda a, k: _bytes(a[0])),
        funcol.all_reduce_coalesced.default: ("all_reduce", lambda a, k: sum(map(_bytes, a[0]))),
        funcol.all_reduce_coalesced_.default: ("all_reduce", lambda a, k: sum(map(_bytes, a[0]))),
        funcol.all_gather_into_tensor.default: ("all_gather", lambda a, k: _bytes(a[0]) * int(a[1])),
        funcol.all_gather_into_tensor_out.default: ("all_gather", lambda a, k: _bytes(a[0]) * int(a[1])),
        funcol.all_gather_into_tensor_coalesced.default:
            ("all_gather", lambda a, k: sum(map(_bytes, a[0])) * int(a[1])),
        funcol.reduce_scatter_tensor.default: ("reduce_scatter", lambda a, k: _bytes(a[0])),
        funcol.reduce_scatter_tensor_out.default: ("reduce_scatter", lambda a, k: _bytes(a[0])),
        funcol.reduce_scatter_tensor_coalesced.default:
            ("reduce_scatter", lambda a, k: sum(map(_bytes, a[0]))),
        funcol.all_to_all_single.default: ("all_to_all", lambda a, k: _bytes(a[0])),
        funcol.broadcast.default: ("broadcast", lambda a, k: _bytes(a[0])),
        funcol.broadcast_.default: ("broadcast", lambda a, k: _bytes(a[0])),
    }
    # not collectives: waiting on an async result, and wrapping a result for autograd
    ignored = {funcol.wait_tensor.default}
    if hasattr(funcol, "_wrap_tensor_autograd"):
        ignored.add(funcol._wrap_tensor_autograd.default)

    class CollectiveCounter(TorchDispatchMode):
        """Counts DTensor's functional collectives: ``counts[op]``, ``payload[op]`` (bytes,
        ledger convention), ``total_payload``. Any other ``_c10d_functional`` op raises, so
        nothing goes uncounted silently."""

        def __init__(self):
            super().__init__()
            self.counts: dict = {}
            self.payload: dict = {}

        @property
        def total_payload(self) -> int:
            return sum(self.payload.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            rule = rules.get(func)
            if rule is not None:
                name, size = rule
                self.counts[name] = self.counts.get(name, 0) + 1
                self.payload[name] = self.payload.get(name, 0) + int(size(args, kwargs))
            elif func not in ignored and getattr(func, "namespace", "") == "_c10d_functional":
                raise NotImplementedError(f"CollectiveCounter has no payload rule for {func}")
            return func(*args, **kwargs)

    return CollectiveCounter


def __getattr__(name):  # lazy: importing this module must not import torch in the parent
    if name == "CollectiveCounter":
        cls = _collective_counter_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# the model sections of the trainer benchmarks (bench_zero, bench_compile)
TINY_MODEL = {"preset": "tiny"}
MID_MODEL = {"preset": None, "vocab_size": 512, "hidden": 256, "layers": 4, "heads": 4, "ffn_hidden": 704,
             "max_seq_len": 128}


def trainer_losses(configs) -> list:
    """On the ranks of a :func:`run_on_fresh_ranks` job: train each config in turn with
    ``gridshard.engine.Trainer``; each run's per-step losses."""
    from gridshard.engine import Trainer

    return [Trainer(c, progress=False).run() for c in configs]


def alternating_trainer_rounds(configs, rounds: int) -> list:
    """On the ranks of a job: one ``Trainer`` per config in the same processes, taking turns
    step by step (:func:`gridshard.planner.calibrate_reference.alternating_step_times`); per config the
    seconds of ``rounds`` timed steps after two warm-up steps."""
    from gridshard.engine import Trainer
    from gridshard.planner.calibrate_reference import alternating_step_times

    return alternating_step_times([Trainer(c, progress=False) for c in configs], rounds + 2)


def equivalence_or_time_main(equivalence: Callable[[], None], step_time: Callable[[int], None]) -> None:
    """The command line of the two-part benchmarks: ``--part equivalence|time [--rounds N]``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["equivalence", "time"], required=True)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    equivalence() if args.part == "equivalence" else step_time(args.rounds)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str = "") -> str:
    """A GitHub-markdown table (readable as plain text too)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [title] if title else []
    out += [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def tensor_to_bytes(t) -> bytes:
    """A tensor as ``torch.save`` bytes (to return it from a rank through a queue)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(t.detach().clone(), buf)
    return buf.getvalue()


def tensor_from_bytes(b: bytes):
    """Inverse of :func:`tensor_to_bytes`."""
    import io

    import torch

    return torch.load(io.BytesIO(b))
