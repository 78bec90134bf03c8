"""Plots of a run: ``loss.png`` (loss vs step) and ``throughput.png`` (tokens/s vs step)
from ``RUN_DIR/metrics.jsonl``. Uses matplotlib's Agg backend (no display needed)."""
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
    """Write the two PNGs into ``out_dir`` (default: ``run_dir``); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    steps = [r["step"] for r in recs]
    paths = []
    for key, ylabel, name in (("loss", "loss (nats/token)", "loss.png"),
                              ("tokens_per_s", "tokens / s (global)", "throughput.png")):
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot(steps, [r[key] for r in recs], marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: {key}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
