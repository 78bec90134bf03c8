"""``train.compile`` measured: the same losses as eager over 20 steps, and the step-time ratio.

``--part equivalence``: 20 steps of the tiny model (global batch 4, micro-batch 2) with and
without ``train.compile`` at (D,T,mode) = (1,1,none), (1,2,1d), (1,2,1d+SP); prints the largest
relative per-step loss difference (issue 12's bar: 1e-5).

``--part time``: step time of compiled over eager at (1,1,none), (1,2,1d), (1,4,1d), 3D at q = 2
(T = 8, micro-batch 4 for the q² batch blocks) and context parallelism C = 2 (ring) for a
mid-size model (h 256, 4 layers, s 128). Both trainers live in the same processes and take
turns step by step (:func:`gridshard.planner.calibrate_reference.alternating_step_times`: a barrier
before each step, the job's step time is the slowest rank's), so the machine's noise hits
them alike; medians over the timed rounds after two warm-up rounds (which include the
compilation).

    .venv/bin/python benchmarks/bench_compile.py --part equivalence|time [--rounds 12]
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
LAYOUTS = [(1, "none", False), (2, "1d", False), (2, "1d", True)]


TIME_LAYOUTS = [("(1,1,none)", 1, "none", 1, 2), ("(1,2,1d)", 2, "1d", 1, 2), ("(1,4,1d)", 4, "1d", 1, 2),
                ("(1,8,3d)", 8, "3d", 1, 4), ("C=2 ring", 1, "none", 2, 2)]   # label, T, mode, C, micro-batch


def _config(T, mode, sp, compile_, model=TINY, steps=20, global_batch=4, micro_batch=2, seq_len=32, context=1):
    return {"model": model, "data": {"kind": "stdlib", "seq_len": seq_len, "max_bytes": 300_000},
            "parallel": {"data": 1, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp, "context": context},
            "train": {"global_batch": global_batch, "micro_batch": micro_batch, "steps": steps, "lr": 3e-3,
                      "warmup_steps": 3, "log_interval": 1, "seed": 3, "eval_interval": 0, "compile": compile_}}



def equivalence():
    rows = []
    for T, mode, sp in LAYOUTS:
        eager, compiled = run_on_fresh_ranks(T, trainer_losses, [_config(T, mode, sp, c) for c in (False, True)],
                                             timeout=3600)[0]
        rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled))
        rows.append([f"(1,{T},{mode}{'+SP' if sp else ''})", len(eager), f"{rel:.1e}"])
        print(rows[-1], flush=True)
    print(format_table(["(D,T,mode)", "steps", "max rel. loss diff, compiled vs eager"], rows))



def step_time(rounds: int):
    rows = []
    for label, T, mode, C, mb in TIME_LAYOUTS:
        cfgs = [_config(T, mode, False, c, model=MID, steps=rounds + 2, global_batch=2 * mb, micro_batch=mb,
                        seq_len=128, context=C) for c in (False, True)]
        per_rank = run_on_fresh_ranks(T * C, alternating_trainer_rounds, cfgs, rounds, timeout=3600)
        job = [[max(r[i][j] for r in per_rank) for j in range(rounds)] for i in range(2)]
        ratios = sorted(c / e for c, e in zip(job[1], job[0]))
        rows.append([label, f"{statistics.median(job[0]) * 1e3:.0f}",
                     f"{statistics.median(job[1]) * 1e3:.0f}",
                     f"{statistics.median(job[1]) / statistics.median(job[0]):.2f}",
                     f"{ratios[len(ratios) // 4]:.2f}–{ratios[3 * len(ratios) // 4]:.2f}"])
        print(rows[-1], flush=True)
    print(format_table(["layout", "eager ms", "compiled ms", "compiled / eager", "per-round ratio IQR"], rows))


if __name__ == "__main__":
    equivalence_or_time_main(equivalence, step_time)
