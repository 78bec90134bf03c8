"""``gridshard diagnose RUN_DIR``: a short report on where a finished (or running) job's time and
memory went, and what to change.

It reads what the trainer writes (``config.yaml``, ``metrics.jsonl``, ``ranks.jsonl``:
:mod:`gridshard.engine.rank_timing`) and asks the planner about the same layout. The figures are
medians over the log steps after the first, which holds the warm-up:

* **step**: measured step time beside the planner's prediction for this layout and hardware
  (:func:`gridshard.planner.evaluate`; ``--hardware``, default ``cpu`` on a CPU run);
* **split**: rank 0's step in seconds: its collectives by parallel dimension (data, tensor, context,
  expert, pipeline sends with the bubble), data loading and compute (the rest), each beside the
  planner's part for this layout; per step, each rank's compute, collective (of which waiting)
  and data-loading seconds and, for rank 0, the bytes its collectives moved on each mesh axis (the
  ledger's payload convention);
* **ranks**: the slowest rank by compute and how long the others waited for it; the straggler the
  trainer named, if any;
* **memory**: each rank's peak beside the memory model's prediction;
* **findings**: each with its evidence and the fix, as the source documents' troubleshooting
  chapter puts them. Where a config change applies, the finding gives it as ``key=value`` overrides
  that pass the config rules on the same number of processes. The findings are: a straggler,
  communication over half of the step, a bubble over a quarter, data loading over a tenth,
  memory under half used (a larger micro-batch) or over 90 % of the prediction's budget (ZeRO,
  recompute), and a tensor or context group that spans nodes (``RUN_DIR/launch.json``,
  :mod:`gridshard.engine.placement`).

``--json`` prints the same as one JSON object.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Optional

from .errors import ConfigError

COMM_SHARE, BUBBLE_SHARE, DATA_SHARE = 0.5, 0.25, 0.1      # finding thresholds, shares of the step


def _jsonl(path: str) -> list:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break                                   # a line cut by a crash ends the file
    return out


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _valid(cfg, overrides: list) -> bool:
    """Whether ``overrides`` applied to ``cfg`` pass the config rules on the same number of processes."""
    from .config import load_config, validate_config

    try:
        validate_config(load_config(cfg, overrides), cfg.world_size, check_data=False)
    except (ConfigError, ValueError):
        return False
    return True


def _fix(cfg, *candidates) -> Optional[list]:
    """The first override list among ``candidates`` that passes the config rules, or None."""
    return next((list(c) for c in candidates if c and _valid(cfg, list(c))), None)


def diagnose(run_dir: str, hardware: Optional[str] = None) -> dict:
    """The report of ``run_dir`` as a dict (module docstring)."""
    from .config import load_config

    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{run_dir} has no config.yaml: it is not a gridshard run directory. Fix: pass the "
                          f"RUN_DIR a `gridshard train --run-dir RUN_DIR` wrote.")
    cfg = load_config(cfg_path)
    records = [r for r in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if "step_time_s" in r]
    if not records:
        raise ConfigError(f"{run_dir}/metrics.jsonl has no log step yet. Fix: diagnose after the first log step "
                          f"(train.log_interval={cfg.train.log_interval}).")
    steady = records[1:] or records
    ranks = _jsonl(os.path.join(run_dir, "ranks.jsonl"))
    ranks_steady = ranks[1:] or ranks
    p = cfg.parallel
    step_s = _median(r["step_time_s"] for r in steady)
    report = {"run_dir": run_dir, "layout": {"data": p.data, "pipeline": p.pipeline, "context": p.context,
                                             "tensor": p.tensor, "tensor_mode": str(p.tensor_mode)},
              "log_steps": [r["step"] for r in records], "step_time_s": step_s,
              "comm_share": _median(r.get("comm_share") for r in steady),
              "bubble_share": _median(r.get("bubble_share") for r in steady),
              "ranks": _rank_split(ranks_steady),
              "rank0_comm_bytes_per_step": _median_dict(r.get("rank0_comm_bytes_per_step", {}) for r in ranks_steady),
              "memory": _memory(steady[-1])}
    predicted = _predicted_step(cfg, hardware)
    report["predicted_step_s"] = None if predicted is None else predicted["total_s"]
    report["split"] = _split(report, _median_dict(r.get("rank0_comm_s_per_step", {}) for r in ranks_steady), predicted)
    report["findings"] = _findings(cfg, report, steady, ranks_steady)
    return report


def _predicted_step(cfg, hardware: Optional[str]) -> Optional[dict]:
    """The planner's step time for the run's own layout, by part (:class:`gridshard.planner.cost_time.StepTime`
    as a dict, with ``total_s``), or None when it cannot price it."""
    from .planner import evaluate, load_hardware
    from .planner.fit import config_layout

    if cfg.model.unmodelled() is not None:
        return None
    hw = load_hardware(hardware or "cpu")
    cand = evaluate(cfg, config_layout(cfg), hw, cfg.world_size, price_too_large=True)
    return None if cand.step is None else cand.step.as_dict()


#: the parallel dimension whose traffic a mesh axis carries (every other axis is a tensor scheme's:
#: tensor, row, col, depth, weight_input, ...)
AXIS_DIMENSION = {"data": "data", "data_context": "data", "expert_data": "data", "context": "context",
                  "expert": "expert", "pipeline": "pipeline", "pipeline_tied": "pipeline"}
#: the planner's parts (StepTime) that price each row of the split
PREDICTED_PARTS = {"compute": ("compute_s", "optimizer_s", "overhead_s"), "data": ("data_comm_s",),
                   "tensor": ("tensor_comm_s",), "context": ("context_comm_s",), "expert": ("expert_comm_s",),
                   "pipeline": ("pipeline_comm_s", "bubble_s")}


def _split(report: dict, axis_seconds: dict, predicted: Optional[dict]) -> list:
    """Rank 0's step, seconds per step: its collectives by parallel dimension (the ledger's timed seconds
    per axis), the pipeline bubble, data loading, and the rest (compute: the math, the optimizer and
    Python); each row beside the planner's parts for the same layout (``PREDICTED_PARTS``)."""
    step_s = report["step_time_s"]
    rank0 = report["ranks"][0] if report["ranks"] else None
    if rank0 is None or step_s is None:
        return []
    comm = {}
    for axis, seconds in axis_seconds.items():
        dim = AXIS_DIMENSION.get(axis, "tensor")
        comm[dim] = comm.get(dim, 0.0) + (seconds or 0.0)
    bubble = (report["bubble_share"] or 0.0) * step_s
    rows = {"data": comm.get("data", 0.0), "tensor": comm.get("tensor", 0.0), "context": comm.get("context", 0.0),
            "expert": comm.get("expert", 0.0), "pipeline": comm.get("pipeline", 0.0) + bubble,
            "data loading": rank0["data_s"] or 0.0}
    rows["compute"] = max(0.0, step_s - sum(rows.values()))
    order = ("compute", "data", "tensor", "context", "expert", "pipeline", "data loading")
    out = []
    for part in order:
        want = None if predicted is None or part not in PREDICTED_PARTS else \
            sum(predicted[k] for k in PREDICTED_PARTS[part])
        if rows[part] or want:
            out.append({"part": part, "measured_s": rows[part], "predicted_s": want})
    return out


def _median_dict(dicts) -> dict:
    dicts = list(dicts)
    keys = sorted({k for d in dicts for k in d})
    return {k: _median(d.get(k) for d in dicts) for k in keys}


def _rank_split(ranks: list) -> list:
    """Per rank, the median over log steps of its seconds per step (compute, comm, wait, data)."""
    if not ranks:
        return []
    world = len(ranks[-1]["ranks"])
    out = []
    for r in range(world):
        rows = [rec["ranks"][r] for rec in ranks if len(rec["ranks"]) == world]
        out.append({"rank": r, **{k: _median(x[k] for x in rows) for k in ("compute_s", "comm_s", "wait_s", "data_s")}})
    return out


def _memory(last: dict) -> list:
    peaks, predicted = last.get("peak_mem_bytes_per_rank") or [], last.get("predicted_mem_bytes_per_rank") or []
    return [{"rank": r, "peak_bytes": peak, "predicted_bytes": predicted[r] if r < len(predicted) else None}
            for r, peak in enumerate(peaks)]


def _findings(cfg, report: dict, steady: list, ranks: list) -> list:
    p, t = cfg.parallel, cfg.train
    step_s, out = report["step_time_s"], []
    named = [r.get("straggler_rank") for r in ranks if r.get("straggler_rank") is not None]
    if named:
        r = statistics.mode(named)
        out.append({"finding": "straggler", "evidence": f"rank {r} was named a straggler at {len(named)} of "
                    f"{len(ranks)} log steps: the others waited for its compute in every collective",
                    "fix": f"check rank {r}'s device and host (clock throttling, other processes on its cores, a slow "
                           "disk for its data); move the job off that machine or restart it there", "overrides": None})
    comm = report["comm_share"]
    if comm is not None and comm > COMM_SHARE:
        overrides = _fix(cfg, [f"parallel.tensor={p.tensor // 2}", f"parallel.data={p.data * 2}"] if p.tensor > 1
                         else None, [f"train.micro_batch={t.micro_batch * 2}"])
        out.append({"finding": "communication", "evidence": f"collectives take {comm:.0%} of the step (median over "
                    f"ranks and log steps)", "fix": "keep tensor groups inside a node and make them smaller, or give "
                    "each collective more work (a larger micro-batch)", "overrides": overrides})
    bubble = report["bubble_share"]
    if bubble is not None and bubble > BUBBLE_SHARE:
        overrides = _fix(cfg, [f"train.global_batch={t.global_batch * 2}"],
                         ["parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2"])
        out.append({"finding": "pipeline bubble", "evidence": f"the stages idle {bubble:.0%} of the schedule",
                    "fix": "more micro-batches per step, or an interleaved / zero-bubble schedule",
                    "overrides": overrides})
    data = _median(r["data_s"] for r in report["ranks"]) if report["ranks"] else None
    if data is not None and step_s and data > DATA_SHARE * step_s:
        out.append({"finding": "data loading", "evidence": f"producing batches takes {data / step_s:.0%} of the step",
                    "fix": "prepare the data once (gridshard prepare-data) and train from the prepared folder",
                    "overrides": None})
    out += _memory_findings(cfg, report["memory"])
    out += _placement_findings(cfg, report["run_dir"])
    return out


def _placement_findings(cfg, run_dir: str) -> list:
    """A tensor or context group whose ranks sit on more than one node (``RUN_DIR/launch.json``,
    :mod:`gridshard.engine.placement`): its per-layer collectives cross the slow links between nodes.
    The fix keeps each such group within a node: size gcd(size, ranks per node), the rest to data."""
    import math

    from .engine.placement import read_launch_record, spanning_groups

    record = read_launch_record(run_dir)
    if record is None:
        return []
    p, per_node, out = cfg.parallel, int(record["ranks_per_node"]), []
    for axis in ("tensor", "context"):
        spanning = spanning_groups(record, (axis,))
        if not spanning:
            continue
        size = len(spanning[0]["ranks"])
        inside = math.gcd(size, per_node)
        data = p.data * size // inside
        mode = ["parallel.tensor_mode=none"] if axis == "tensor" and inside == 1 else []
        overrides = _fix(cfg, [f"parallel.{axis}={inside}", f"parallel.data={data}", *mode],
                         [f"parallel.{axis}={inside}", f"parallel.data={data}", "parallel.tensor_mode=1d"]
                         if axis == "tensor" and inside > 1 else None)
        first = spanning[0]
        out.append({"finding": f"{axis} group spans nodes", "evidence": f"{len(spanning)} of "
                    f"{len(record['groups'].get(axis, []))} {axis} groups span nodes (ranks "
                    f"{', '.join(str(r) for r in first['ranks'])} on nodes {', '.join(first['nodes'])}; "
                    f"{per_node} ranks per node): their collectives in every layer cross the links between nodes",
                    "fix": f"keep each {axis} group inside a node ({axis} size at most the ranks per node, "
                           f"{per_node}), and give the rest to data parallelism", "overrides": overrides})
    return out


def _memory_findings(cfg, memory: list) -> list:
    """Memory far below the prediction's budget (a larger micro-batch), or near it (ZeRO, recompute)."""
    from .planner.fit import machine_budget

    p, t = cfg.parallel, cfg.train
    peaks = [m["peak_bytes"] for m in memory if m["peak_bytes"]]
    if not peaks:
        return []
    budget = machine_budget(cfg.world_size).per_rank
    worst = max(peaks)
    if worst < 0.5 * budget:
        overrides = _fix(cfg, [f"train.micro_batch={t.micro_batch * 2}"])
        return [{"finding": "memory has room", "evidence": f"the largest peak is {worst / 2**30:.2f} GiB of the "
                 f"{budget / 2**30:.2f} GiB a rank may use here", "fix": "raise the micro-batch (or the global batch)",
                 "overrides": overrides}] if overrides else []
    if worst > 0.9 * budget:
        overrides = _fix(cfg, [f"train.zero={t.zero + 1}"] if t.zero < 3 and p.data > 1 else None,
                         ["train.recompute=full"] if t.recompute != "full" else None)
        return [{"finding": "memory nearly full", "evidence": f"the largest peak is {worst / 2**30:.2f} GiB of "
                 f"{budget / 2**30:.2f} GiB", "fix": "shard more state (ZeRO) or recompute activations",
                 "overrides": overrides}]
    return []


def format_report(report: dict) -> str:
    """The report as text (module docstring)."""
    L = report["layout"]
    lines = [f"gridshard diagnose {report['run_dir']}: D{L['data']} P{L['pipeline']} C{L['context']} "
             f"T{L['tensor']} {L['tensor_mode']}; log steps {report['log_steps'][0]}…{report['log_steps'][-1]} "
             f"(medians after the first)"]
    pred = report["predicted_step_s"]
    lines.append(f"step: {report['step_time_s']:.4f} s measured"
                 + (f", {pred:.4f} s predicted by the planner for this layout ({report['step_time_s'] / pred:.2f}×)"
                    if pred else ", not priced by the planner"))
    comm, bubble = report["comm_share"], report["bubble_share"]
    lines.append("comm share: " + (f"{comm:.0%}" if comm is not None else "not timed (train.time_comm)")
                 + (f"; pipeline bubble {bubble:.0%}" if bubble is not None else ""))
    if report["ranks"]:
        lines.append("per rank, seconds per step:   compute    comm (wait)        data")
        for r in report["ranks"]:
            lines.append(f"  rank {r['rank']:<4}                {r['compute_s']:9.4f} {r['comm_s']:7.4f} "
                         f"({r['wait_s']:.4f}) {r['data_s']:9.4f}")
        slow = max(report["ranks"], key=lambda r: r["compute_s"])
        lines.append(f"slowest rank by compute: {slow['rank']}; the longest wait: "
                     f"{max(r['wait_s'] for r in report['ranks']):.4f} s per step")
    if report["split"]:
        lines.append("rank 0's step, seconds:        measured   predicted")
        for row in report["split"]:
            want = f"{row['predicted_s']:11.4f}" if row["predicted_s"] is not None else "          –"
            label = row["part"] if row["part"] in ("compute", "data loading") else f"{row['part']} comm" + \
                (" + bubble" if row["part"] == "pipeline" else "")
            lines.append(f"  {label:<26}{row['measured_s']:10.4f} {want}")
    if report["rank0_comm_bytes_per_step"]:
        lines.append("rank 0's collective bytes per step: " + ", ".join(
            f"{axis} {b / 2**20:.3f} MiB" for axis, b in report["rank0_comm_bytes_per_step"].items()))
    if report["memory"]:
        lines.append("memory, peak / predicted: " + ", ".join(
            f"rank {m['rank']} {m['peak_bytes'] / 2**20:.0f}/"
            + (f"{m['predicted_bytes'] / 2**20:.0f} MiB" if m["predicted_bytes"] else "– MiB") for m in report["memory"]))
    if not report["findings"]:
        lines.append("findings: none")
    for f in report["findings"]:
        fix = f["fix"] + (f"; override: {' '.join(f['overrides'])}" if f["overrides"] else "")
        lines.append(f"finding: {f['finding']}: {f['evidence']}. Fix: {fix}.")
    return "\n".join(lines)
