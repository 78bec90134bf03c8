"""Step-time ratios of two rows measured side by side, for two checkouts of gridshard, in
alternation: e.g. 1D+SP / 1D at T = 4, or 2D / 1D at T = q², for an old commit and a new one.

One *measurement* runs, in one checkout, the numerator row then the denominator row (each in
fresh processes, with that checkout's own ``benchmarks/bench_tp1d.py`` or ``bench_tp2d.py`` and
its own gridshard), and records num/den from the two rows' median step times. Measurements
alternate old/new (the first of each pair alternating too), so slow drifts of the shared
machine's load hit both checkouts alike. Reported per checkout: the median of its ratios and
the range; and the median row times.

    .venv/bin/python benchmarks/paired_ratio.py --old ../wt_base --new . --bench tp1d --block mlp \\
        --T 4 --pairs 5                       # 1D+SP / 1D
    .venv/bin/python benchmarks/paired_ratio.py --old ../wt_base --new . --bench tp2d --block mlp \\
        --q 2 --pairs 5                       # 2D / 1D

Each row runs in a subprocess whose ``sys.path`` starts with its checkout, so the two
checkouts never share a module.

Besides the wall step time (the benches' own: after a barrier, max over ranks) every timed
step's CPU time is recorded on each rank (``time.process_time``: all threads of the rank,
gloo's included) and summed over the ranks: the CPU-seconds the job spends per step. On a
machine shared with other jobs the wall time mostly measures the others' load; the CPU time
measures the work the step does (compute, copies, the backend's reductions and transfers),
though cache and frequency effects of the load remain. Both ratios are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_ROW = r'''
import json, sys
root = sys.argv[1]
sys.path.insert(0, root)
sys.path.append(sys.argv[6])                     # this driver's folder: ``paired_ratio.timed_row``
bench, block, spec, opts = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
from benchmarks._runner import median, run_on_fresh_ranks, step_times_of_job
from paired_ratio import timed_row
if bench == "tp1d":
    from benchmarks.bench_tp1d import bench_variant
    impl, T, sp = spec
    args = dict(hidden=1024, seq=256, batch=8, heads=16, kv_heads=16, ffn=2816, warmup=2, iters=5,
                init_std=0.02, seed=0, check=False, timeout=1800.0)
    args.update(opts)
    res = run_on_fresh_ranks(T, timed_row, "benchmarks.bench_tp1d", "bench_variant", block, impl, T, sp, args,
                             timeout=1800.0)
    times = step_times_of_job([r["times"] for r in res])
    cpu = [sum(ts) for ts in zip(*[r["cpu_times"][0] for r in res])]
    extra = {"counts": res[0]["counts"], "comm": res[0]["comm"]}
else:
    from benchmarks.bench_tp2d import bench_row
    impl, q = spec
    args = dict(batch=12, seq=72, hidden=576, heads=36, kv_heads=36, ffn=1584, warmup=2, iters=7,
                init_std=0.02, seed=0, check=False, blocks=[block])
    args.update(opts)
    res = run_on_fresh_ranks(q * q if impl != "single" else 1, timed_row, "benchmarks.bench_tp2d", "bench_row", impl,
                             q, args, timeout=1800.0)
    times = step_times_of_job([r[block]["times"] for r in res])
    cpu = [sum(ts) for ts in zip(*[r[block]["cpu_times"][0] for r in res])]
    extra = {"calls": res[0][block]["calls"], "comm": res[0][block]["comm"]}
print("RESULT " + json.dumps({"median": median(times), "cpu": median(cpu), **extra}))
'''


def timed_row(module: str, fn: str, *args):
    """Run ``module.fn(*args)`` on this rank with the module's ``time_steps`` replaced by one
    that also records each timed step's CPU time; the result (or, for a dict of blocks, each
    block's row) gets ``cpu_times`` (one list per ``time_steps`` call, in call order)."""
    import importlib
    import time as _time

    import torch.distributed as dist

    mod = importlib.import_module(module)
    cpu_lists = []

    def time_steps(step, warmup, iters):
        for _ in range(warmup):
            step()
        wall, cpu = [], []
        for _ in range(iters):
            dist.barrier()
            t0, c0 = _time.perf_counter(), _time.process_time()
            step()
            wall.append(_time.perf_counter() - t0)
            cpu.append(_time.process_time() - c0)
        cpu_lists.append(cpu)
        return wall

    mod.time_steps = time_steps
    out = getattr(mod, fn)(*args)
    if "times" in out:
        out["cpu_times"] = cpu_lists
    else:                                   # bench_tp2d: {block: row}, time_steps called per block in order
        for row, cpu in zip(out.values(), cpu_lists):
            row["cpu_times"] = [cpu]
    return out


def run_in_checkout(root: str, code: str, *args: str, what: str = "measurement") -> dict:
    """Run ``code`` (a ``python -c`` script) in checkout ``root`` — its own gridshard first on
    ``sys.path``, no inherited ``PYTHONPATH`` — with argv ``root, *args, benchmarks folder``;
    returns the JSON of its ``RESULT {...}`` stdout line."""
    out = subprocess.run([sys.executable, "-c", code, os.path.abspath(root), *args,
                          os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, cwd=os.path.abspath(root),
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} in {root} failed:\n{out.stderr[-3000:]}")


def run_row(root, bench, block, spec, opts):
    return run_in_checkout(root, _ROW, bench, block, json.dumps(spec), json.dumps(opts), what=f"row {spec}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--bench", choices=["tp1d", "tp2d"], required=True)
    p.add_argument("--block", choices=["mlp", "transformer", "prenorm_mlp"], default="mlp")
    p.add_argument("--T", type=int, default=4, help="tp1d: tensor size (ratio 1D+SP / 1D)")
    p.add_argument("--q", type=int, default=2, help="tp2d: grid side (ratio 2D / 1D at T = q²)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--opts", default="{}", help="JSON overrides of the bench's shape arguments")
    a = p.parse_args(argv)
    opts = json.loads(a.opts)
    if a.bench == "tp1d":
        num, den, label = ("gridshard", a.T, True), ("gridshard", a.T, False), f"1D+SP/1D T={a.T}"
    else:
        num, den, label = ("2d", a.q), ("1d", a.q), f"2D/1D q={a.q}"
    trees = {"old": a.old, "new": a.new}
    got = {k: [] for k in trees}
    t0 = time.perf_counter()
    for i in range(a.pairs):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for k in order:
            first, second = (num, den) if (i // 2) % 2 == 0 else (den, num)
            r1 = run_row(trees[k], a.bench, a.block, first, opts)
            r2 = run_row(trees[k], a.bench, a.block, second, opts)
            rn, rd = (r1, r2) if first == num else (r2, r1)
            got[k].append((rn, rd))
            print(f"  pair {i + 1}/{a.pairs} {k}: {label} {a.block} = {rn['median'] / rd['median']:.3f} "
                  f"({rn['median'] * 1e3:.1f} / {rd['median'] * 1e3:.1f} ms), CPU {rn['cpu'] / rd['cpu']:.3f} "
                  f"({rn['cpu'] * 1e3:.1f} / {rd['cpu'] * 1e3:.1f} CPU-ms) {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"{label} {a.block}, {a.pairs} measurements per checkout, alternated old/new")
    for k in trees:
        ratios = [rn["median"] / rd["median"] for rn, rd in got[k]]
        cpu = [rn["cpu"] / rd["cpu"] for rn, rd in got[k]]
        info = {x: got[k][-1][0].get(x) for x in ("counts", "calls") if x in got[k][-1][0]}
        print(f"  {k:<4} {trees[k]}: wall ratio median {statistics.median(ratios):.3f} (range {min(ratios):.3f}–"
              f"{max(ratios):.3f}); CPU ratio median {statistics.median(cpu):.3f} (range {min(cpu):.3f}–"
              f"{max(cpu):.3f}); wall num {statistics.median([rn['median'] for rn, _ in got[k]]) * 1e3:.1f} ms, "
              f"den {statistics.median([rd['median'] for _, rd in got[k]]) * 1e3:.1f} ms; CPU num "
              f"{statistics.median([rn['cpu'] for rn, _ in got[k]]) * 1e3:.1f}, den "
              f"{statistics.median([rd['cpu'] for _, rd in got[k]]) * 1e3:.1f} CPU-ms; num {info}")


if __name__ == "__main__":
    main()
