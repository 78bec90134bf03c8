"""ZeRO-3's saving of peak resident memory on CPU ranks against the predicted saving, under
glibc's default malloc and under fixed malloc thresholds, and what those cost in step time
(issue 23; quoted in docs/memory.md "Resident memory on CPU").

D = 4 gloo ranks, T = 1, fp32, the ``mid`` model of ``bench_memory.py`` (h 512, 8 layers,
f 1376, V 4096: 29.5 M parameters), micro-batch 2 × 128 tokens.

``--part memory`` (default): each variant — ZeRO 0 or 3 × allocator: ``glibc default`` (dynamic
mmap and trim thresholds), ``fixed`` (both fixed at 128 KiB: ``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=131072``) or ``MMAP/TRIM`` in MiB — trains ``--steps`` steps in its own
fresh processes; rank 0's peak resident memory (``peak_mem_bytes_per_rank``: VmHWM), the
trainer's ``predicted_mem_bytes``, the median step time after the first step; then per allocator

    measured saving / predicted saving = (peak₀ − peak₃) / (predicted₀ − predicted₃)

(issue 23 asks for 0.8–1.2). Variants run ``--rounds`` times, the allocator order alternating.

``--part time``: one group of processes, a ZeRO-0 and a ZeRO-3 trainer taking turns step by
step, the thresholds (``--thresholds MMAP/TRIM`` in KiB; the last is the reference, by default
32 MiB / 64 MiB, glibc's dynamic steady state) rotating every ``--steps`` steps, ``--rounds`` times:
a change of machine load hits every setting alike.

``--part pages``: one group of processes, two ZeRO-3 trainers under glibc's default malloc taking
turns step by step: ``train.zero3_host_memory: pages`` (:mod:`gridshard.zero.pages`: chunks and
AdamW moments in one arena, layer buffers in their own mappings, gloo staging in the reducer's
resident pool) and ``heap`` (the default: every buffer and chunk a ``torch`` tensor, released by
``resize_``, the collectives allocating their own transients); the median step time of each and
their ratio, ``--rounds`` × ``--steps`` timed steps after 2 warm-up steps.
``--allocators pages``: glibc's default malloc with ``train.zero3_host_memory: pages`` for ZeRO-3
(ZeRO-0 as under glibc default; the memory part's saving and ratio for pages, ZeRO-3's default
on a Linux CPU since c636b87).

``--part cpu``: what a ZeRO-3 ``pages`` step costs this process, free of the machine's load: rank
0's CPU seconds (user + system, every thread: ``getrusage``) and minor page faults around each
``Trainer.step``, medians after the first of ``--steps``, and its peak (run it in two trees
alternately to compare code versions).

``--part phases``: where the peak is. One ZeRO-3 trainer (``--memory pages`` or ``heap``; ZeRO-0
with ``--zero 0``), ``--steps`` steps in fresh processes; rank 0's resident set (``VmRSS``), peak
(``VmHWM``) and glibc's heap (``mallinfo2``: arena size and the free bytes in it) at each phase of
the last step — after the forward, as each unit's reduction is launched and finished, around
``sync`` and ``after_step`` — and the staging pool's resident bytes.

    .venv/bin/python benchmarks/bench_zero3_resident.py [--steps 6] [--rounds 2] [--allocators fixed "glibc default" 8/64]
    .venv/bin/python benchmarks/bench_zero3_resident.py --part time [--thresholds 128/128 32768/65536]
    .venv/bin/python benchmarks/bench_zero3_resident.py --part pages [--steps 4] [--rounds 3]
    .venv/bin/python benchmarks/bench_zero3_resident.py --part phases [--steps 3] [--memory heap] [--zero 0]
    .venv/bin/python benchmarks/bench_zero3_resident.py --part cpu [--steps 6]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import format_table, run_on_fresh_ranks  # noqa: E402

MID = {"preset": None, "vocab_size": 4096, "hidden": 512, "layers": 8, "heads": 8, "ffn_hidden": 1376,
       "max_seq_len": 256}
D = 4
ALLOCATORS = ("fixed", "glibc default")
#: (mmap, trim) thresholds timed by --part time; the last is glibc's dynamic steady state
THRESHOLDS = ((128 << 10, 128 << 10), (1 << 20, 1 << 20), (4 << 20, 4 << 20), (32 << 20, 64 << 20))


def _config(zero: int, steps: int, host_memory: str = "heap") -> dict:
    return {"model": MID, "data": {"kind": "stdlib", "seq_len": 128, "max_bytes": 400_000},
            "parallel": {"data": D, "tensor": 1, "tensor_mode": "none"},
            "train": {"global_batch": 2 * D, "micro_batch": 2, "steps": steps, "lr": 1e-3, "warmup_steps": 0,
                      "log_interval": 1, "seed": 0, "zero": zero,
                      **({"zero3_host_memory": host_memory} if zero == 3 else {})}}


def fix_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> None:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, ·)`` and ``mallopt(M_TRIM_THRESHOLD, ·)`` in this process:
    what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do at start-up (a fixed value
    switches glibc's dynamic thresholds off)."""
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(-3, mmap_bytes) != 1 or mallopt(-1, trim_bytes) != 1:       # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        raise RuntimeError("mallopt failed")


def _train(zero: int, steps: int, allocator: str) -> dict:
    from gridshard.engine import Trainer

    if allocator == "fixed":
        fix_malloc_thresholds(128 << 10, 128 << 10)
    elif allocator not in ("glibc default", "pages"):        # "MMAP/TRIM" thresholds in MiB
        fix_malloc_thresholds(*(int(x) << 20 for x in allocator.split("/")))
    trainer = Trainer(_config(zero, steps, "pages" if allocator == "pages" else "heap"), progress=False)
    trainer.run()
    last = trainer.history[-1]
    times = [h["step_time_s"] for h in trainer.history[1:]]
    return {"peak": last["peak_mem_bytes_per_rank"][0], "predicted": last["predicted_mem_bytes_per_rank"][0],
            "step_s": statistics.median(times)}


def _time_pages(steps: int, rounds: int) -> dict:
    """Two ZeRO-3 trainers taking turns (``--part pages``): seconds per step of each."""
    import torch

    from gridshard.engine import Trainer
    from gridshard.planner.calibrate_reference import alternating_step_times

    heap = Trainer(_config(3, steps * rounds + 2), progress=False)
    mapped = Trainer(_config(3, steps * rounds + 2, host_memory="pages"), progress=False)
    assert heap.reducer.arena is None and mapped.reducer.arena is not None
    times = alternating_step_times([mapped, heap], steps * rounds + 2, warmup=2)
    same = all(torch.equal(a.param_chunk, b.param_chunk) for a, b in zip(mapped.reducer.units, heap.reducer.units))
    return {"mapped": times[0], "heap": times[1], "same parameters": same}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _phase_reading() -> tuple:
    """(VmRSS, VmHWM, heap arena, free in it) of this process in bytes (``/proc/self/status``, glibc's
    ``mallinfo2``)."""
    kib = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                kib[key] = int(value.split()[0]) << 10
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return kib["VmRSS"], kib["VmHWM"], info.arena, info.fordblks


def _phases(zero: int, steps: int, memory: str) -> list:
    """``--part phases``: (phase, VmRSS, VmHWM, heap, free in heap, staging pool) bytes on this rank,
    read at each phase of the last of ``steps`` steps."""
    from gridshard.engine import Trainer

    trainer = Trainer(_config(zero, steps, memory), progress=False)
    reducer, rows, last = trainer.reducer, [], [False]
    reduction = getattr(reducer, "reduction", reducer)

    def mark(name: str) -> None:
        if last[0]:
            pool = reducer.staging.nbytes_held() if getattr(reducer, "staging", None) is not None else 0
            rows.append((name, *_phase_reading(), pool))

    def wrap(owner, method: str, label) -> None:
        inner = getattr(owner, method)

        def wrapped(*args, **kwargs):
            mark(label(args, "<"))
            out = inner(*args, **kwargs)
            mark(label(args, ">"))
            return out
        setattr(owner, method, wrapped)

    for method in ("_launch", "_finish"):
        wrap(reduction, method, lambda a, end, m=method: f"{m[1:]} {a[0].name} {end}")
    for method in ("sync", "after_step"):
        wrap(reducer, method, lambda a, end, m=method: f"{m} {end}")
    trainer.model.register_forward_hook(lambda *_: mark("forward done"))
    for k in range(steps):
        last[0] = k == steps - 1
        mark("step begins")
        trainer.step(k)
    mark("step done")
    return rows


def _cpu_steps(steps: int) -> dict:
    """``--part cpu``: per step after the first, this rank's (user s, system s, minor faults) of a
    ZeRO-3 ``pages`` trainer, and its peak resident set."""
    import resource

    from gridshard.engine import Trainer

    trainer = Trainer(_config(3, steps, "pages"), progress=False)
    rows = []
    for k in range(steps):
        a = resource.getrusage(resource.RUSAGE_SELF)
        trainer.step(k)
        b = resource.getrusage(resource.RUSAGE_SELF)
        rows.append((b.ru_utime - a.ru_utime, b.ru_stime - a.ru_stime, b.ru_minflt - a.ru_minflt))
    return {"rows": rows[1:], "peak": _phase_reading()[1]}


def _time_thresholds(steps: int, rounds: int, thresholds) -> dict:
    """In one group of processes: a ZeRO-0 and a ZeRO-3 trainer take turns, each step under
    another fixed (mmap, trim) threshold pair; seconds per (stage, mmap threshold)."""
    from gridshard.engine import Trainer
    from gridshard.planner.calibrate_reference import alternating_step_times

    trainers = {z: Trainer(_config(z, steps), progress=False) for z in (0, 3)}
    alternating_step_times(list(trainers.values()), 2, warmup=2)
    times: dict = {}
    for _ in range(rounds):
        for mmap_bytes, trim_bytes in thresholds:
            fix_malloc_thresholds(mmap_bytes, trim_bytes)
            got = alternating_step_times(list(trainers.values()), steps, warmup=0)
            for z, ts in zip(trainers, got):
                times.setdefault((z, mmap_bytes), []).extend(ts)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--part", choices=("memory", "time", "pages", "phases", "cpu"), default="memory")
    ap.add_argument("--memory", choices=("pages", "heap"), default="pages", help="--part phases: ZeRO-3's host memory")
    ap.add_argument("--zero", type=int, choices=(0, 3), default=3, help="--part phases: the stage")
    ap.add_argument("--allocators", nargs="+", default=list(ALLOCATORS),
                    help='"fixed" (build_job\'s), "glibc default", "pages" (glibc default, ZeRO-3 host pages) '
                         'or "MMAP/TRIM" thresholds in MiB')
    ap.add_argument("--thresholds", nargs="+", help='--part time: "MMAP/TRIM" pairs in KiB')
    args = ap.parse_args(argv)
    allocators = tuple(args.allocators)
    if args.part == "pages":
        got = run_on_fresh_ranks(D, _time_pages, args.steps, args.rounds, timeout=3600)[0]
        mapped, heap = (statistics.median(got[k]) for k in ("mapped", "heap"))
        print(f"D = {D}, mid model, ZeRO-3, rank 0, {len(got['mapped'])} steps each, taking turns: median step "
              f"{1000 * mapped:.0f} ms (zero3_host_memory pages) / {1000 * heap:.0f} ms (heap) = "
              f"{mapped / heap:.3f}; bit-identical parameters after: {got['same parameters']}")
        return None
    if args.part == "cpu":
        got = run_on_fresh_ranks(D, _cpu_steps, args.steps, timeout=1800)[0]
        user, system, faults = (statistics.median(r[i] for r in got["rows"]) for i in range(3))
        print(f"D = {D}, mid model, ZeRO-3 pages, rank 0, median of {len(got['rows'])} steps: CPU "
              f"{1000 * (user + system):.0f} ms per step ({1000 * system:.0f} ms system), {faults:.0f} minor "
              f"faults ({faults * 4 / 1024:.0f} MiB of 4 KiB pages); peak {got['peak'] / 2**20:.0f} MiB")
        return None
    if args.part == "phases":
        rows = run_on_fresh_ranks(D, _phases, args.zero, args.steps, args.memory, timeout=1800)[0]
        mib = 2**20
        print(f"D = {D}, mid model, ZeRO-{args.zero}" + (f" {args.memory}" if args.zero == 3 else "")
              + f", rank 0, step {args.steps} of {args.steps} (MiB)")
        print(format_table(["phase", "VmRSS", "VmHWM", "heap", "free in heap", "staging pool"],
                           [[name] + [f"{x / mib:.0f}" for x in values] for name, *values in rows]))
        return None
    if args.part == "time":
        pairs = THRESHOLDS if not args.thresholds else [tuple(int(x) << 10 for x in t.split("/"))
                                                         for t in args.thresholds]
        return _print_times(run_on_fresh_ranks(D, _time_thresholds, args.steps, args.rounds, pairs,
                                               timeout=3600)[0], pairs)
    got: dict = {}
    for r in range(args.rounds):
        for allocator in (allocators if r % 2 == 0 else allocators[::-1]):
            for zero in (0, 3):
                res = run_on_fresh_ranks(D, _train, zero, args.steps, allocator, timeout=1800)[0]
                got.setdefault((allocator, zero), []).append(res)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("peak", "predicted", "step_s")}
           for k, v in got.items()}
    mib = 2**20
    rows = [[a, f"ZeRO-{z}", f"{med[a, z]['peak'] / mib:.0f}", f"{med[a, z]['predicted'] / mib:.0f}",
             f"{1000 * med[a, z]['step_s']:.0f}"] for a in allocators for z in (0, 3)]
    print(f"D = {D}, mid model (29.5 M parameters), fp32, {args.steps} steps, medians of {args.rounds} rounds")
    print(format_table(["allocator", "stage", "peak RSS rank 0 (MiB)", "predicted (MiB)", "step ms"], rows))
    rows = []
    for a in allocators:
        measured = med[a, 0]["peak"] - med[a, 3]["peak"]
        predicted = med[a, 0]["predicted"] - med[a, 3]["predicted"]
        rows.append([a, f"{measured / mib:.0f}", f"{predicted / mib:.0f}", f"{measured / predicted:.2f}"])
    print(format_table(["allocator", "measured saving (MiB)", "predicted saving (MiB)", "ratio"], rows))
    for z in (0, 3):
        if ("fixed", z) in med and ("glibc default", z) in med:
            print(f"ZeRO-{z} step time fixed / glibc default: "
                  f"{med['fixed', z]['step_s'] / med['glibc default', z]['step_s']:.3f}")


def _print_times(times: dict, pairs) -> None:
    ref = {z: statistics.median(times[z, pairs[-1][0]]) for z in (0, 3)}
    rows = [[f"{m >> 10} KiB", f"{t >> 10} KiB", f"ZeRO-{z}", f"{1000 * statistics.median(times[z, m]):.0f}",
             f"{statistics.median(times[z, m]) / ref[z]:.3f}"] for m, t in pairs for z in (0, 3)]
    print(f"D = {D}, mid model, rank 0's step times, ZeRO-0 and ZeRO-3 taking turns, thresholds rotating")
    print(format_table(["mmap threshold", "trim threshold", "stage", "median step ms", "ratio to last"], rows))


if __name__ == "__main__":
    main()
