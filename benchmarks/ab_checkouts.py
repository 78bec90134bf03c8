"""One measurement in two checkouts of gridshard, in alternation: the step time of a change
against the commit before it, side by side on one (shared, noisy) machine.

Jobs (each run in a fresh subprocess whose ``sys.path`` starts with its checkout, so the two
checkouts never share a module):

* ``block3d``: one Llama decoder block at 3D (q = 2, 8 ranks), forward + backward, through the
  checkout's own ``benchmarks/bench_tp_block.py`` (``--modes 3d``): the job's step time (slowest
  rank, median of ``--rounds``), its CPU time summed over the ranks, and the ledger's wire bytes
  and calls per rank;
* ``train3d``: ``gridshard train`` of the tiny Llama at (D, P, T) = (1, 1, 8), ``tensor_mode: 3d``,
  ``--steps`` steps: the median of the logged ``step_time_s`` after the first log interval
  (``RUN_DIR/metrics.jsonl``), and the final loss (the same in both checkouts when the change
  keeps the arithmetic);
* ``train1d``: the same at (D, T) = (2, 2), ``tensor_mode: 1d``, on 4 processes;
* ``trainpp``: the same at (D, P) = (2, 2), 1F1B, bf16 storage under ZeRO-3, on 4 processes (the
  pipeline's receive buffers, ZeRO-3's gathers from the fp32 masters);
* ``trainzb``: the same at (D, P, V) = (2, 2, 2), zero bubble, 4 layers (torch's runtime schedule:
  the sends given back, the stage meter).

Runs alternate old/new, the first of each pair alternating too, so slow drifts of the machine's
load hit both alike. Reported per checkout: the median and range of each figure over the pairs,
and the median of the paired ratios new/old.

    git worktree add /tmp/R_old HEAD~1
    .venv/bin/python benchmarks/ab_checkouts.py --old /tmp/R_old --new . --job block3d --pairs 5
    .venv/bin/python benchmarks/ab_checkouts.py --old /tmp/R_old --new . --job train3d --pairs 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_BLOCK = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks import bench_tp_block as bench
from gridshard.testing import run_on_ranks
a = bench.parse_args(["--modes", "3d", "--rounds", sys.argv[2]])
rows = {r["mode"]: r for r in bench.summarize(run_on_ranks(bench.WORLD, bench.measure, a, timeout=1800), a)}
r = rows["3d"]
print("RESULT " + json.dumps({"step_ms": r["step_ms"], "cpu_ms": r["cpu_s"] * 1e3, "wire_kib": r["wire"] / 1024,
                              "calls": r["calls"]}))
'''


def _run_block(root: str, a) -> dict:
    out = subprocess.run([sys.executable, "-c", _BLOCK, os.path.abspath(root), str(a.rounds)], cwd=root,
                         capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"block3d in {root} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


TRAIN_LAYOUTS = {  # job: (processes, layout overrides)
    "train3d": (8, ["parallel.data=1", "parallel.tensor=8", "parallel.tensor_mode=3d"]),
    "train1d": (4, ["parallel.data=2", "parallel.tensor=2", "parallel.tensor_mode=1d"]),
    # pipeline stages' receive buffers, bf16 ZeRO-3's gathers from fp32 masters
    "trainpp": (4, ["parallel.data=2", "parallel.tensor=1", "parallel.pipeline=2", "train.zero=3",
                    "train.precision=bf16", "train.micro_batch=2"]),
    # two stages per rank on torch's runtime (sends given back, the stage meter's saved-tensor hook)
    "trainzb": (4, ["parallel.data=2", "parallel.tensor=1", "parallel.pipeline=2", "model.layers=4",
                    "parallel.pipeline_schedule=zero_bubble", "parallel.virtual_stages=2", "train.micro_batch=2"]),
}


def _run_train(root: str, a) -> dict:
    nproc, layout = TRAIN_LAYOUTS[a.job]
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gridshard", "train", "configs/tiny.yaml", "--nproc", str(nproc), "--run-dir",
               run_dir, *layout, f"train.steps={a.steps}", "train.log_interval=5", "train.warmup_steps=2"]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=3600, env=env)
        path = os.path.join(run_dir, "metrics.jsonl")
        if out.returncode or not os.path.exists(path):
            raise SystemExit(f"{a.job} in {root} failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n"
                             f"{out.stderr[-3000:]}")
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in recs if "step_time_s" in r]
    return {"step_ms": statistics.median(r["step_time_s"] for r in steps[1:]) * 1e3, "loss": steps[-1]["loss"]}


JOBS = {"block3d": _run_block, "train3d": _run_train, "train1d": _run_train, "trainpp": _run_train,
        "trainzb": _run_train}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the checkout before the change (e.g. a git worktree)")
    p.add_argument("--new", default=".", help="the checkout with the change")
    p.add_argument("--job", choices=sorted(JOBS), required=True)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7, help="block3d: timed rounds per run")
    p.add_argument("--steps", type=int, default=30, help="train3d: optimizer steps per run")
    a = p.parse_args(argv)
    runs = {"old": [], "new": []}
    for k in range(a.pairs):
        for side in (("old", "new") if k % 2 == 0 else ("new", "old")):
            res = JOBS[a.job](getattr(a, side), a)
            runs[side].append(res)
            print(f"pair {k} {side}: {json.dumps(res)}", flush=True)
    keys = list(runs["old"][0])
    print(f"\n{a.job}, {a.pairs} pairs (old = {a.old}, new = {a.new})")
    print("| figure | old median (range) | new median (range) | median of paired new/old |")
    print("|---|---|---|---|")
    for key in keys:
        cells = []
        for side in ("old", "new"):
            v = [r[key] for r in runs[side]]
            cells.append(f"{statistics.median(v):.4g} ({min(v):.4g}–{max(v):.4g})")
        ratio = statistics.median(n[key] / o[key] for o, n in zip(runs["old"], runs["new"]) if o[key])
        print(f"| {key} | {cells[0]} | {cells[1]} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
