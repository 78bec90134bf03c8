"""``gridshard plan --emulate K`` against real runs of the layouts it ranks (issue 43).

The planner ranks the layouts of ``CONFIG`` on ``--gpus`` ranks of this machine, emulates the
first and last rank of its top ``--top`` layouts (:func:`gridshard.planner.emulate.emulated_plan`)
and re-ranks them. Each of those layouts is then trained for real, ``--rounds`` times, interleaved
(layout 1, 2, 3, 1, 2, 3, ...) so that the machine's load drifts over all of them alike, by the
user's own command: ``gridshard train LAYOUT.yaml --nproc N`` with the layout's config as ``plan
--write`` writes it and ``train.steps`` = ``--steps``.

Measured step = the median ``step_time_s`` of a run's log intervals after the first (the first
holds each rank's one-time work: the allocator's first pages, the first gloo connections), and
the median of that over the rounds. Printed per layout: the planner's own prediction, the
emulated one, the measured step, and emulated ÷ measured.

    .venv/bin/python benchmarks/plan_emulate_real.py [CONFIG] [--gpus 4] [--top 3] [--steps 120] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import format_table  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def real_step(config: dict, world: int, steps: int, workdir: str) -> float:
    """Train ``config`` for ``steps`` steps on ``world`` local ranks (``gridshard train``); the median
    ``step_time_s`` of its log intervals after the first."""
    import yaml

    config = json.loads(json.dumps(config))
    config.setdefault("train", {}).update(steps=steps, log_interval=10)
    path = os.path.join(workdir, "layout.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    run_dir = tempfile.mkdtemp(dir=workdir)
    subprocess.run([sys.executable, "-m", "gridshard", "train", path, "--nproc", str(world), "--run-dir", run_dir],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f if line.strip()]
    return statistics.median(times[1:] or times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    from gridshard.config import load_config
    from gridshard.planner.emulate import emulated_plan
    from gridshard.planner.report import written_config
    from gridshard.planner.search import plan

    result = plan(args.config, args.gpus)
    rows = emulated_plan(result, args.top)
    by_label = {c.layout.label(): c.layout for c in result.candidates[:args.top]}
    configs = [written_config(result, by_label[r["layout"]]) for r in rows]
    for c in configs:
        load_config(c)                                    # refused here, before any rank starts
    measured = [[] for _ in rows]
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):
            for i, c in enumerate(configs):
                measured[i].append(real_step(c, args.gpus, args.steps, workdir))
    table = []
    for r, m in zip(rows, measured):
        real = statistics.median(m)
        table.append([r["layout"], f"{r['predicted_step_s']:.4f}", f"{r['emulated_step_s']:.4f}",
                      " ".join(f"{x:.4f}" for x in m), f"{real:.4f}", f"{r['emulated_step_s'] / real:.2f}"])
    print(f"{args.config} on {args.gpus} ranks, {args.steps} steps × {args.rounds} rounds per layout")
    print(format_table(["layout (emulated rank order)", "planner s", "emulated s", "measured s per round",
                        "measured s", "emulated/measured"], table))


if __name__ == "__main__":
    main()
