"""The planner's predictions against measurements on this machine (issue 13).

For each layout: a fresh group of gloo ranks (one thread each) trains ``--steps`` steps with
``gridshard.engine.Trainer`` (log_interval 1); measured = the median ``step_time_s`` of the steps
after the first two, and each rank's ``peak_mem_bytes_per_rank`` (peak RSS on CPU: fresh processes,
since the peak is a high-water mark). Predicted = ``gridshard.planner.evaluate`` with a profile
calibrated on this machine at the same rank count (``gridshard plan --calibrate --nproc N``), run
first by this script. Layouts: a fixed list spanning none / 1d / 1d+SP / 2d, ZeRO 0–3, recompute
and P = 1/2 on 4 ranks (``tiny``) and 8 ranks (``small``), plus the planner's own top 3 for each
(model, N), so that "the planner's top 3 contains the measured fastest" can be checked.

    .venv/bin/python benchmarks/bench_planner.py [--steps 10] [--only 4|8] [--profile-dir /tmp] [--json out.json]

The ranks build a ``Trainer`` directly, so no stop handler is installed
(``control.stop_installed()`` is False there): the planner is asked without the per-step stop
agreement (``evaluate(..., stop_agreement=False)``). ``--json`` also writes the measured rows
(layout, measured step and peak), so that a later cost model can be compared against the same
measurements (``--rescore out.json``: predictions only, no training).

Prints one row per layout (predicted and measured step time and peak memory, residuals) and the
summary: median / max |residual|, and whether the measured fastest is in the planner's top 3.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import format_table, run_on_fresh_ranks  # noqa: E402

TINY = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 128, "max_bytes": 300_000},
        "train": {"global_batch": 16, "steps": 6, "log_interval": 1, "warmup_steps": 1, "lr": 3e-3}}
SMALL = {"model": {"preset": None, "vocab_size": 512, "hidden": 256, "layers": 4, "heads": 8, "ffn_hidden": 704,
                   "max_seq_len": 128},
         "data": {"kind": "stdlib", "seq_len": 128, "max_bytes": 300_000},
         "train": {"global_batch": 16, "steps": 6, "log_interval": 1, "warmup_steps": 1, "lr": 3e-3}}

# (D, P, T, mode, sp, zero, recompute, micro_batch, schedule)
LAYOUTS = {
    4: ("tiny", TINY, [(4, 1, 1, "none", False, 0, "none", 4, "1f1b"), (4, 1, 1, "none", False, 1, "none", 2, "1f1b"),
                       (4, 1, 1, "none", False, 3, "full", 4, "1f1b"), (2, 1, 2, "1d", False, 0, "none", 4, "1f1b"),
                       (2, 1, 2, "1d", True, 2, "selective", 4, "1f1b"), (1, 1, 4, "2d", False, 0, "none", 4, "1f1b"),
                       (2, 2, 1, "none", False, 0, "none", 2, "1f1b"), (1, 2, 2, "1d", False, 0, "none", 4, "gpipe")]),
    8: ("small", SMALL, [(8, 1, 1, "none", False, 0, "none", 2, "1f1b"), (4, 1, 2, "1d", False, 1, "none", 2, "1f1b"),
                         (2, 1, 4, "1d", True, 0, "full", 4, "1f1b"), (2, 1, 4, "2d", False, 0, "none", 4, "1f1b"),
                         (4, 2, 1, "none", False, 2, "none", 2, "1f1b"), (2, 2, 2, "1d", False, 3, "none", 2, "1f1b")]),
}


def _config(base: dict, layout) -> dict:
    cfg = json.loads(json.dumps(base))
    D, P, T, mode, sp, zero, rc, m, sched, *rest = layout
    cfg["parallel"] = {"data": D, "pipeline": P, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp,
                       "pipeline_schedule": sched, "virtual_stages": rest[0] if rest else 1}
    cfg["train"].update(zero=zero, recompute=rc, micro_batch=m)
    return cfg


def _train(cfg: dict):
    from gridshard.engine import Trainer

    tr = Trainer(cfg, progress=False)
    tr.run()
    return tr.history


def _as_layout(t):
    from gridshard.planner.layouts import Layout

    return Layout(*t[:8], pipeline_schedule=t[8], virtual_stages=t[9] if len(t) > 9 else 1)


def run(world: int, steps: int, profile_dir: str, rows: list, summary: list):
    from gridshard.config import load_config
    from gridshard.planner import evaluate, load_hardware, plan
    from gridshard.planner.calibrate import calibrate

    name, base, fixed = LAYOUTS[world]
    base = json.loads(json.dumps(base))
    base["train"]["steps"] = steps
    prof_path = os.path.join(profile_dir, f"gridshard-profile-cpu{world}.json")
    if not os.path.isfile(prof_path):
        t0 = time.time()
        calibrate(nproc=world, out=prof_path)
        print(f"calibrated {prof_path} in {time.time() - t0:.0f} s", flush=True)
    hw = load_hardware(prof_path)
    cfg0 = load_config(base)
    top3 = [c.layout for c in plan(base, world, hardware=hw).candidates[:3]]
    layouts = [_as_layout(t) for t in fixed]
    layouts += [x for x in top3 if x not in layouts]
    measured = []
    for lay in layouts:
        t = (lay.data, lay.pipeline, lay.tensor, lay.tensor_mode, lay.sequence_parallel, lay.zero, lay.recompute,
             lay.micro_batch, lay.pipeline_schedule, lay.virtual_stages)
        cand = evaluate(cfg0, lay, hw, world, stop_agreement=False)
        if not cand.feasible:
            print(f"skip {lay.label()}: {cand.reason}", flush=True)
            continue
        t0 = time.time()
        hist = run_on_fresh_ranks(world, _train, _config(base, t), timeout=1800)[0]
        step_s = statistics.median([r["step_time_s"] for r in hist[2:]] or [hist[-1]["step_time_s"]])
        peak = max(hist[-1]["peak_mem_bytes_per_rank"])
        trainer_pred = max(hist[-1]["predicted_mem_bytes_per_rank"])
        pred_mem, pred_s = cand.memory.total, cand.predicted_step_s
        base_b = cand.memory.baseline
        row = [name, str(world), lay.label() + (" *" if lay in top3 else ""), f"{pred_s:.3f}", f"{step_s:.3f}",
               f"{(pred_s - step_s) / step_s:+.0%}", f"{pred_mem / 2**20:.0f}", f"{peak / 2**20:.0f}",
               f"{(pred_mem - peak) / peak:+.1%}", f"{(pred_mem - base_b) / 2**20:.1f}",
               f"{(peak - base_b) / 2**20:.1f}", f"{trainer_pred / 2**20:.0f}", f"{time.time() - t0:.0f}",
               f"{os.getloadavg()[0]:.1f}"]
        rows.append(row)
        measured.append((lay, step_s, pred_s, peak, pred_mem))
        RECORDS.append({"world": world, "layout": list(t), "step_s": step_s, "peak": peak, "load": os.getloadavg()[0],
                        "top3": lay in top3, "wall_s": time.time() - t0})
        if JSON_OUT:
            with open(JSON_OUT, "w") as f:
                json.dump(RECORDS, f, indent=1)
        print(" | ".join(row), flush=True)
    fastest = min(measured, key=lambda x: x[1])[0]
    summary.append(f"{name} on {world} ranks: measured fastest {fastest.label()}; planner top 3: "
                   f"{[x.label() for x in top3]} -> {'contains it' if fastest in top3 else 'does NOT contain it'}")
    summary.append(f"  |step residual| median {statistics.median(abs(p - s) / s for _, s, p, _, _ in measured):.0%}, "
                   f"max {max(abs(p - s) / s for _, s, p, _, _ in measured):.0%}; |memory residual| median "
                   f"{statistics.median(abs(pm - m) / m for *_, m, pm in measured):.1%}, max "
                   f"{max(abs(pm - m) / m for *_, m, pm in measured):.1%}")


RECORDS: list = []
JSON_OUT = None


def rescore(path: str, profile_dir: str):
    """Predictions of the current cost model against the measurements stored by ``--json``."""
    from gridshard.config import load_config
    from gridshard.planner import evaluate, load_hardware, plan

    recs = json.load(open(path))
    for world in sorted({r["world"] for r in recs}):
        name, base, _ = LAYOUTS[world]
        hw = load_hardware(os.path.join(profile_dir, f"gridshard-profile-cpu{world}.json"))
        cfg0 = load_config(base)
        top3 = [c.layout for c in plan(base, world, hardware=hw).candidates[:3]]
        res, best = [], None
        for r in (r for r in recs if r["world"] == world):
            lay = _as_layout(r["layout"])
            pred = evaluate(cfg0, lay, hw, world, stop_agreement=False).predicted_step_s
            res.append((pred - r["step_s"]) / r["step_s"])
            if best is None or r["step_s"] < best[1]:
                best = (lay, r["step_s"])
            print(f"| {name} | {world} | {lay.label() + (' *' if lay in top3 else '')} | {pred:.3f} | {r['step_s']:.3f} "
                  f"| {res[-1]:+.0%} | {r['load']:.1f} |")
        print(f"{name} on {world}: |step residual| median {statistics.median(map(abs, res)):.0%}, max "
              f"{max(map(abs, res)):.0%}, under {sum(x < 0 for x in res)} of {len(res)}; measured fastest "
              f"{best[0].label()}; current top 3 {[x.label() for x in top3]} -> "
              f"{'contains it' if best[0] in top3 else 'does NOT contain it'}")


HEADERS = ["model", "N", "layout (* planner top 3)", "pred step s", "meas step s", "step resid", "pred MiB",
           "meas MiB", "mem resid", "pred - base MiB", "meas - base MiB", "trainer pred MiB", "wall s", "load"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", type=int, choices=[4, 8], default=None)
    ap.add_argument("--profile-dir", default="/tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rescore", default=None)
    args = ap.parse_args()
    JSON_OUT = args.json
    if args.rescore:
        rescore(args.rescore, args.profile_dir)
        sys.exit(0)
    rows, summary = [], []
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for world in ([args.only] if args.only else [4, 8]):
        run(world, args.steps, args.profile_dir, rows, summary)
    print(format_table(HEADERS, rows))
    print("\n".join(summary))
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RECORDS, f, indent=1)
