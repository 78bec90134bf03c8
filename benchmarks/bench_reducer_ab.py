"""Whole training steps of two checkouts of gridshard side by side (old commit against new), in
alternation: the step time of one ``Trainer`` config — e.g. ZeRO-0 or ZeRO-2 at D = 4 — before and
after a change to the gradient reduction.

One *measurement* runs the config in one checkout in fresh processes (that checkout's own
gridshard and ``benchmarks/_runner.py``): ``--warmup`` untimed steps, then ``--steps`` timed ones,
each after a barrier; a step's time is the slowest rank's, and each rank's CPU time
(``time.process_time``, gloo's threads included) is summed over ranks. Measurements alternate
old/new (the first of each pair alternating too), so slow drifts of a shared machine's load hit
both alike. Reported: per checkout the median step (wall and CPU) over measurements, and the
median over pairs of new/old (each pair's two measurements ran back to back).

    .venv/bin/python benchmarks/bench_reducer_ab.py --old /tmp/old --new . --D 4 --zero 0 --pairs 5

Each measurement runs in a subprocess whose ``sys.path`` starts with its checkout, so the two
checkouts never share a module.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

_MEASURE = r'''
import json, sys
root = sys.argv[1]
sys.path.insert(0, root)
sys.path.append(sys.argv[3])                     # this driver's folder: ``bench_reducer_ab.timed_steps``
from benchmarks._runner import median, run_on_fresh_ranks
from bench_reducer_ab import timed_steps
spec = json.loads(sys.argv[2])
res = run_on_fresh_ranks(spec["world"], timed_steps, spec["config"], spec["warmup"], spec["steps"], timeout=1800.0)
wall = [max(ts) for ts in zip(*[r[0] for r in res])]
cpu = [sum(ts) for ts in zip(*[r[1] for r in res])]
print("RESULT " + json.dumps({"wall": median(wall), "cpu": median(cpu)}))
'''


def timed_steps(config: dict, warmup: int, steps: int) -> tuple:
    """On every rank: build a ``Trainer``, run ``warmup`` + ``steps`` steps; (wall, CPU) seconds of
    each timed step, a barrier before and after each."""
    import time

    import torch.distributed as dist

    from gridshard.engine import Trainer

    trainer = Trainer(config, progress=False)
    wall, cpu = [], []
    for k in range(warmup + steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(k)
        dist.barrier()
        if k >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu


MODELS = {"tiny": {"preset": "tiny"},                                   # 0.1 M parameters
          "mid": {"preset": None, "vocab_size": 512, "hidden": 256, "layers": 4, "heads": 4, "ffn_hidden": 704,
                  "max_seq_len": 128}}                                  # 3.4 M parameters (benchmarks' MID_MODEL)


def config(D: int, T: int, mode: str, zero: int, micro_batch: int, steps: int, model: str, sp: bool = False,
           recompute: str = "none", P: int = 1, schedule: str = "1f1b", global_batch: int = 0) -> dict:
    """``P`` > 1: that many pipeline stages under ``schedule``; ``global_batch`` 0: 2·D."""
    return {"model": MODELS[model], "data": {"kind": "stdlib", "seq_len": 64, "max_bytes": 300_000},
            "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp, "pipeline": P,
                         "pipeline_schedule": schedule},
            "train": {"global_batch": global_batch or 2 * D, "micro_batch": micro_batch, "steps": steps, "lr": 3e-3,
                      "warmup_steps": 2, "grad_clip": 0.5, "log_interval": steps, "zero": zero,
                      "recompute": recompute}}


def measure(root: str, spec: dict) -> dict:
    from paired_ratio import run_in_checkout

    return run_in_checkout(root, _MEASURE, json.dumps(spec))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--D", type=int, default=4)
    p.add_argument("--T", type=int, default=1)
    p.add_argument("--mode", default="none")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--sp", action="store_true", help="parallel.sequence_parallel (1d)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--micro-batch", type=int, default=2, help="2: one micro-batch per data rank; 1: two")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--P", type=int, default=1, help="pipeline stages")
    p.add_argument("--schedule", default="1f1b", help="parallel.pipeline_schedule (P > 1)")
    p.add_argument("--global-batch", type=int, default=0, help="0: 2·D")
    p.add_argument("--no-overlap-new", action="store_true",
                   help="train.overlap_grad_reduce=false in the new checkout only (whole-gradient accumulation)")
    a = p.parse_args(argv)
    cfg = config(a.D, a.T, a.mode, a.zero, a.micro_batch, a.warmup + a.steps, a.model, a.sp, a.recompute,
                 a.P, a.schedule, a.global_batch)
    spec = {"world": a.D * a.P * a.T, "config": cfg, "warmup": a.warmup, "steps": a.steps}
    new_cfg = {**cfg, "train": {**cfg["train"], "overlap_grad_reduce": False}} if a.no_overlap_new else cfg
    specs = {"old": spec, "new": {**spec, "config": new_cfg}}
    trees = {"old": a.old, "new": a.new}
    got = {k: [] for k in trees}
    for i in range(a.pairs):
        for k in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
            got[k].append(measure(trees[k], specs[k]))
            print(f"  pair {i + 1}/{a.pairs} {k}: {got[k][-1]['wall'] * 1e3:.1f} ms, "
                  f"{got[k][-1]['cpu'] * 1e3:.1f} CPU-ms", file=sys.stderr, flush=True)
    label = (f"D={a.D} P={a.P}{' ' + a.schedule if a.P > 1 else ''} T={a.T} {a.mode}{'+SP' if a.sp else ''} "
             f"ZeRO-{a.zero} recompute={a.recompute} micro_batch={a.micro_batch} "
             f"global_batch={cfg['train']['global_batch']} {a.model}"
             f"{' (new: overlap_grad_reduce=false)' if a.no_overlap_new else ''}")
    wall = [n["wall"] / o["wall"] for o, n in zip(got["old"], got["new"])]
    cpu = [n["cpu"] / o["cpu"] for o, n in zip(got["old"], got["new"])]
    med = {k: (statistics.median(r["wall"] for r in got[k]) * 1e3, statistics.median(r["cpu"] for r in got[k]) * 1e3)
           for k in trees}
    print(f"{label}, {a.pairs} pairs: old {med['old'][0]:.1f} ms / {med['old'][1]:.1f} CPU-ms, new "
          f"{med['new'][0]:.1f} ms / {med['new'][1]:.1f} CPU-ms; new/old wall median {statistics.median(wall):.3f} "
          f"(range {min(wall):.3f}–{max(wall):.3f}), CPU median {statistics.median(cpu):.3f} "
          f"(range {min(cpu):.3f}–{max(cpu):.3f})")


if __name__ == "__main__":
    main()
