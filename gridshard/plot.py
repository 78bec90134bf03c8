"""Plots of a run from ``RUN_DIR/metrics.jsonl`` (matplotlib's Agg backend, no display needed):

* ``metrics.png``: six panels against the optimizer step — training loss with the validation
  loss (``val_loss``, on evaluation steps), learning rate, gradient norm (before clipping),
  global tokens/s, peak memory of every rank (MiB) and the communication share (%);
* ``loss.png`` and ``throughput.png``: the first and fourth panels alone;
* ``accuracy.png`` (a classifier's run, ``model.kind: vit``): ``accuracy`` and ``val_accuracy``
  on the evaluation steps, on 0–1;
* ``moe_load.png`` (a Mixture-of-Experts run): each expert's share of the token-slots
  (``moe_load``, summed over the MoE layers), one line per expert; 1/n is balanced.

Every logged record is drawn, the first included, and each x axis starts at step 0. Axes a
reader can trust: quantities that cannot be negative (tokens/s, memory, share, lr, grad norm)
have a y axis starting at 0, so a small wobble is not shown as a collapse; the communication
share is drawn on 0–100 %. A missing value (null: a step without valid targets, comm share
off on GPUs) leaves a gap instead of being drawn as 0.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .errors import ConfigError


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist: `gridshard plot` needs the run directory of a finished "
                          f"`gridshard train` (it writes metrics.jsonl). Fix: pass that directory, e.g. runs/default.")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ConfigError(f"{path} is empty: the run logged no step yet. Fix: train at least train.log_interval steps.")
    return records


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> list:
    """Write the PNGs (module docstring) into ``out_dir`` (default: ``run_dir``); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    steps = [r["step"] for r in recs]
    paths = [_panels(plt, recs, run_dir, os.path.join(out_dir, "metrics.png"))]
    for key, ylabel, name, ylim in (("loss", "loss (nats/token)", "loss.png", {}),
                                    ("tokens_per_s", "tokens / s (global)", "throughput.png", {"bottom": 0})):
        paths.append(_single(plt, run_dir, os.path.join(out_dir, name), key, ylabel, ylim,
                             [(steps, [_num(r.get(key)) for r in recs], None)]))
    evals = [r for r in recs if r.get("accuracy") is not None]     # a classifier's evaluation steps, on 0–1
    if evals:
        paths.append(_single(plt, run_dir, os.path.join(out_dir, "accuracy.png"), "accuracy", "accuracy",
                             {"bottom": 0, "top": 1},
                             [([r["step"] for r in evals], [_num(r.get(key)) for r in evals], label)
                              for key, label in (("accuracy", "train"), ("val_accuracy", "validation"))]))
    loads = [r for r in recs if r.get("moe_load")]
    if loads:
        paths.append(_single(plt, run_dir, os.path.join(out_dir, "moe_load.png"), "moe_load",
                             "share of token-slots", {"bottom": 0},
                             [([r["step"] for r in loads], [r["moe_load"][e] for r in loads], f"expert {e}")
                              for e in range(len(loads[0]["moe_load"]))]))
    return paths


def _single(plt, run_dir: str, path: str, key: str, ylabel: str, ylim: dict, series: list) -> str:
    """One panel of ``series`` [(steps, values, label or None)] against the step, saved to ``path``."""
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for xs, ys, label in series:
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlim(left=0)
    if ylim:
        ax.set_ylim(**ylim)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: {key}")
    if any(label for _, _, label in series):
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _num(x):
    return float("nan") if x is None else x


def _from_zero(ax) -> None:
    """A y axis from 0 to 5 % above the highest value."""
    ax.set_ylim(bottom=0)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.05)


def _panels(plt, recs: list, run_dir: str, path: str) -> str:
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), dpi=100)
    ax = axes[0, 0]
    ax.plot(steps, [_num(r.get("loss")) for r in recs], marker="o", markersize=3, label="train")
    evals = [r for r in recs if r.get("val_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], marker="s", markersize=4,
                label="validation")
    ax.legend()
    ax.set_ylabel("loss (nats/token)")
    for ax, key, label, scale in ((axes[0, 1], "lr", "learning rate", 1), (axes[0, 2], "grad_norm",
                                  "grad norm (before clipping)", 1),
                                  (axes[1, 0], "tokens_per_s", "tokens / s (global)", 1),
                                  (axes[1, 2], "comm_share", "time in communication (%)", 100)):
        ax.plot(steps, [_num(r.get(key)) * scale for r in recs], marker="o", markersize=3)
        ax.set_ylabel(label)
        _from_zero(ax)
        if key == "comm_share":
            ax.set_ylim(0, 100)
    ax = axes[1, 1]
    per_rank = [r.get("peak_mem_bytes_per_rank") or [r.get("peak_mem_bytes")] for r in recs]
    for rank in range(max(len(m) for m in per_rank)):
        ax.plot(steps, [_num(m[rank]) / 2**20 if rank < len(m) and m[rank] is not None else float("nan")
                        for m in per_rank], marker="o", markersize=2, label=f"rank {rank}")
    if len(per_rank[0]) <= 8:
        ax.legend(fontsize=7)
    ax.set_ylabel("peak memory (MiB)")
    _from_zero(ax)
    for ax in axes.flat:
        ax.set_xlim(0, max(steps) * 1.02 + 0.5)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {len(recs)} records, steps {steps[0]}–{steps[-1]}")
    return _save(plt, fig, path)
