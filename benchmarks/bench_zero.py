"""ZeRO and activation recompute, measured: equivalence over 30 steps and step time side by side.

``--part equivalence``: 30 steps (global batch 8, micro-batch 1: accumulation; clipping
active) of the tiny model at ZeRO 1, 2, 3 against ZeRO 0 at (D,T,mode) = (4,1,none),
(2,2,1d), (2,2,1d+SP) and 2D D=2 × q=2 (8 ranks, micro-batch 2); recompute full and
selective against none at (2,2,1d+SP); bf16 at ZeRO 1/2/3 against bf16 ZeRO 0 at (4,1,none).
Prints the largest relative per-step loss difference.

``--part time``: step time of ZeRO 1/2/3 relative to ZeRO 0, and of recompute
selective/full relative to none, at (4,1,none) and (2,2,1d) with a mid-size model
(h 256, 4 layers, s 128). All variants live in the same processes and take turns step by
step (a barrier before each step; the job's step time is the slowest rank's), so machine
noise hits them alike; medians over the timed rounds, two warm-up rounds.

    .venv/bin/python benchmarks/bench_zero.py --part equivalence|time [--rounds 12]
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import MID_MODEL as MID  # noqa: E402
from _runner import TINY_MODEL as TINY  # noqa: E402
from _runner import (alternating_trainer_rounds, equivalence_or_time_main, format_table,  # noqa: E402
                     run_on_fresh_ranks, trainer_losses)


def _config(D, T, mode, sp, zero=0, recompute="none", precision="fp32", model=TINY, steps=30, global_batch=8,
            micro_batch=1, seq_len=32):
    return {"model": model, "data": {"kind": "stdlib", "seq_len": seq_len, "max_bytes": 300_000},
            "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp},
            "train": {"global_batch": global_batch, "micro_batch": micro_batch, "steps": steps, "lr": 3e-3,
                      "warmup_steps": 3, "grad_clip": 0.5, "log_interval": 1, "seed": 3, "zero": zero,
                      "recompute": recompute, "precision": precision}}



def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


EQ_LAYOUTS = [(4, 1, "none", False, 1), (2, 2, "1d", False, 1), (2, 2, "1d", True, 1), (2, 4, "2d", False, 2)]


def equivalence():
    rows = []
    for D, T, mode, sp, mb in EQ_LAYOUTS:
        cfgs = [_config(D, T, mode, sp, zero=z, micro_batch=mb) for z in range(4)]
        ref, *others = run_on_fresh_ranks(D * T, trainer_losses, cfgs, timeout=1800)[0]
        name = f"({D},{T},{mode}{'+SP' if sp else ''})"
        for z, got in enumerate(others, start=1):
            rows.append([name, "fp32", f"ZeRO-{z} vs ZeRO-0", f"{_rel(got, ref):.1e}"])
            print(rows[-1], flush=True)
    cfgs = [_config(2, 2, "1d", True, recompute=r) for r in ("none", "selective", "full")]
    ref, *others = run_on_fresh_ranks(4, trainer_losses, cfgs, timeout=1800)[0]
    for r, got in zip(("selective", "full"), others):
        rows.append(["(2,2,1d+SP)", "fp32", f"recompute {r} vs none", f"{_rel(got, ref):.1e}"])
        print(rows[-1], flush=True)
    cfgs = [_config(4, 1, "none", False, zero=z, precision="bf16") for z in range(4)]
    ref, *others = run_on_fresh_ranks(4, trainer_losses, cfgs, timeout=1800)[0]
    for z, got in enumerate(others, start=1):
        rows.append(["(4,1,none)", "bf16", f"ZeRO-{z} vs ZeRO-0", f"{_rel(got, ref):.1e}"])
        print(rows[-1], flush=True)
    print(format_table(["(D,T,mode)", "precision", "runs", "max rel. loss diff, 30 steps"], rows))



def step_time(rounds: int):
    rows = []
    for D, T, mode in ((4, 1, "none"), (2, 2, "1d")):
        base = dict(model=MID, global_batch=8, micro_batch=2, seq_len=128)
        variants = [("ZeRO-0", {}), ("ZeRO-1", {"zero": 1}), ("ZeRO-2", {"zero": 2}), ("ZeRO-3", {"zero": 3}),
                    ("recompute selective", {"recompute": "selective"}), ("recompute full", {"recompute": "full"})]
        cfgs = [_config(D, T, mode, False, **base, **v) for _, v in variants]
        per_rank = run_on_fresh_ranks(D * T, alternating_trainer_rounds, cfgs, rounds, timeout=3600)
        job = [[max(r[i][j] for r in per_rank) for j in range(rounds)] for i in range(len(cfgs))]
        ref = statistics.median(job[0])
        for (name, _), ts in zip(variants, job):
            ratios = sorted(t / r for t, r in zip(ts, job[0]))
            rows.append([f"({D},{T},{mode})", name, f"{statistics.median(ts) * 1e3:.0f}",
                         f"{statistics.median(ts) / ref:.2f}",
                         f"{ratios[len(ratios) // 4]:.2f}–{ratios[3 * len(ratios) // 4]:.2f}"])
            print(rows[-1], flush=True)
    print(format_table(["(D,T,mode)", "variant", "median step ms", "ratio to ZeRO-0 / none",
                        "per-round ratio IQR"], rows))


if __name__ == "__main__":
    equivalence_or_time_main(equivalence, step_time)
