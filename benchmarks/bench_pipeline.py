"""Pipeline parallelism, measured: the full layout × schedule equivalence matrix, the bubble
against its formula, and the activations each schedule keeps in flight.

``--part equivalence``: 30 steps of an 8-layer tiny model at every (D, P, T, mode) of
issue 10 × every schedule × tied/untied, against the one-process run: the largest
relative loss difference over the steps.

``--part bubble``: P = 2 and 4 (one stage per rank, T = D = 1; h 256, 8 layers, s 64),
A = 4, 8, 16 micro-batches, each schedule; the measured bubble share on the worst stage
(1 − time in forward/backward ÷ wall time of the schedule's step,
:class:`gridshard.pipeline.meter.StageMeter`; median over steps 2–4) next to
(P−1)/(A+P−1) (interleaved: (P−1)/(V·A+P−1)).

``--part memory``: P = 4, A = 8: peak micro-batches in flight and peak saved activation
bytes per stage, 1F1B against GPipe.

    .venv/bin/python benchmarks/bench_pipeline.py --part equivalence|bubble|memory
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import format_table, run_on_fresh_ranks  # noqa: E402

from gridshard.theory.pipeline import bubble_fraction, peak_in_flight  # noqa: E402

MODEL = {"preset": "tiny", "layers": 8}


def _config(D, P, T, mode, sp, schedule, V, tied, steps=30, global_batch=16, micro_batch=2, seq_len=32):
    return {"model": {**MODEL, "tie_embeddings": tied},
            "data": {"kind": "stdlib", "seq_len": seq_len, "max_bytes": 300_000},
            "parallel": {"data": D, "pipeline": P, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp,
                         "pipeline_schedule": schedule, "virtual_stages": V},
            "train": {"global_batch": global_batch, "micro_batch": micro_batch, "steps": steps, "lr": 3e-3,
                      "warmup_steps": 3, "grad_clip": 0.5, "log_interval": 1, "seed": 3}}


def _train(cfg):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    meter = trainer.pipeline.meter if trainer.pipeline is not None else None
    return {"losses": losses, "bubble": [h["bubble_share"] for h in trainer.history],
            "in_flight": meter.peak_in_flight if meter else 0, "saved": meter.peak_saved_bytes if meter else 0}


LAYOUTS = [(1, 2, 1, "none", False), (1, 4, 1, "none", False), (1, 2, 2, "1d", False), (1, 2, 2, "1d", True),
           (2, 2, 1, "none", False), (1, 2, 4, "2d", False), (2, 2, 2, "1d", False)]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]


def equivalence():
    rows = []
    for tied in (False, True):
        ref = run_on_fresh_ranks(1, _train, _config(1, 1, 1, "none", False, "1f1b", 1, tied))[0]["losses"]
        for D, P, T, mode, sp in LAYOUTS:
            for schedule, V in SCHEDULES:
                got = run_on_fresh_ranks(D * P * T, _train, _config(D, P, T, mode, sp, schedule, V, tied))[0]
                rel = max(abs(a - b) / b for a, b in zip(got["losses"], ref))
                rows.append([f"({D},{P},{T},{mode}{'+SP' if sp else ''})", schedule, "tied" if tied else "untied",
                             f"{rel:.1e}"])
                print(rows[-1], flush=True)
    print(format_table(["(D,P,T,mode)", "schedule", "embeddings", "max rel. loss diff, 30 steps"], rows))


def bubble():
    rows = []
    for P in (2, 4):
        for A in (4, 8, 16):
            for schedule, V in SCHEDULES:
                if V > 1 and A % P:
                    continue
                cfg = _config(1, P, 1, "none", False, schedule, V, False, steps=4, global_batch=A * 2, micro_batch=2,
                              seq_len=64)
                cfg["model"] = {"preset": None, "vocab_size": 256, "hidden": 256, "layers": 8, "heads": 4,
                                "ffn_hidden": 704, "max_seq_len": 64}
                res = run_on_fresh_ranks(P, _train, cfg)[0]
                measured = statistics.median(res["bubble"][1:])
                formula = "—" if schedule == "zero_bubble" else f"{bubble_fraction(P, A, schedule, V):.2f}"
                rows.append([P, A, schedule, f"{measured:.2f}", formula])
                print(rows[-1], flush=True)
    print(format_table(["P", "micro-batches A", "schedule", "measured bubble (worst stage)", "formula"], rows))


def memory():
    rows = []
    P, A = 4, 8
    for schedule in ("1f1b", "gpipe"):
        res = run_on_fresh_ranks(P, _train, _config(1, P, 1, "none", False, schedule, 1, False, steps=1,
                                                    global_batch=A * 2))
        for stage, r in enumerate(res):
            rows.append([schedule, stage, r["in_flight"], peak_in_flight(stage, P, A, schedule),
                         f"{r['saved'] / 2**20:.2f}"])
    print(format_table(["schedule", "stage", "peak micro-batches in flight", "formula", "peak saved MiB"], rows))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["equivalence", "bubble", "memory"], required=True)
    {"equivalence": equivalence, "bubble": bubble, "memory": memory}[ap.parse_args().part]()
