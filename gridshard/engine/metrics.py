"""What a training run reports: throughput, MFU, memory, communication share, and the files.

Per log line (every ``log_interval`` steps) — see ``docs/training.md``:

* ``loss``: cross-entropy of that step's global batch (nats/token), the mean over its
  valid targets (those not equal to ``data.ignore_token``); null when it has none;
* ``valid_tokens``: the number of those valid targets (G·s without ``ignore_token``);
* ``lr``, ``grad_norm`` (global, before clipping);
* ``tokens_per_s``: global tokens of the interval / its wall time;
* ``mfu``: :func:`gridshard.theory.training.mfu` over the device's dense peak
  (``train.peak_flops``, else :mod:`gridshard.peak_flops` by exact device name; null when
  unknown, e.g. on CPU);
* ``peak_mem_bytes``: the largest over ranks of CUDA max allocated during the log interval
  (peak stats reset after each log line), or of the process's max RSS on CPU (whole run);
  ``peak_mem_bytes_per_rank`` lists all;
* ``peak_mem_reserved_bytes``: the largest over ranks of CUDA max reserved during the interval
  (the caching allocator's hold: what ``nvidia-smi`` sees, less the context); null on CPU;
* ``comm_share``: time inside recorded collectives / wall time of the interval,
  averaged over ranks (the job ledger's ``timing``);
* ``step``, ``step_time_s``, ``tokens``, ``elapsed_s``, ``loss_scale`` (fp16);
* ``skipped_steps``: steps whose update ``train.on_nonfinite=skip`` dropped so far (0 otherwise);
* ``val_loss`` on evaluation steps only (``train.eval_interval``; the mean loss over the
  validation windows, :meth:`gridshard.engine.trainer.Trainer.evaluate`).

Sinks (``train.log_to``): ``jsonl`` → ``RUN_DIR/metrics.jsonl``; ``tensorboard`` → event files
in ``RUN_DIR/tb`` through ``torch.utils.tensorboard`` (every numeric field as a scalar
``train/<field>`` at its step, ``val_loss`` as ``val/loss``).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from ..peak_flops import peak_flops_of
from .memory_meter import process_peak_rss


def device_peak_flops(device: torch.device, precision: str, tf32: bool = False,
                      override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s per device for MFU: ``override`` (``train.peak_flops``) when given, else the
    datasheet figure of this CUDA device's exact name (:mod:`gridshard.peak_flops`; fp32 with
    ``tf32`` on → the TF32 rate), else None (CPU, unknown GPU: MFU not reported)."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), "tf32" if precision == "fp32" and tf32 else precision)


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak: CUDA ``max_memory_allocated``; CPU the process's peak RSS
    (:func:`process_peak_rss`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return process_peak_rss()


def interval_memory_peaks(device: torch.device) -> tuple:
    """(peak allocated bytes, peak reserved bytes or None) of this rank over the log interval.

    CUDA: ``max_memory_allocated`` (tensors) and ``max_memory_reserved`` (what the caching
    allocator holds from the driver: allocated + cached free blocks + fragmentation) since the
    previous call, then ``reset_peak_memory_stats`` so the next interval starts from the memory
    in use then. CPU: the process's max RSS (:func:`peak_memory_bytes`, a whole-run peak; there
    is no reset) and None (no allocator reserve to report)."""
    if device.type == "cuda":
        peaks = int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peaks
    return peak_memory_bytes(device), None


def _start_jsonl(path: str, keep_until_step: Optional[int]) -> None:
    """Start ``path`` empty, or for a resumed run with the records of steps ≤ ``keep_until_step``."""
    kept = []
    if keep_until_step is not None and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= keep_until_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    break                           # a line cut by the crash ends what is kept
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class RunFiles:
    """``RUN_DIR/config.yaml``, ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/ranks.jsonl`` (written by rank 0 only)."""

    def __init__(self, run_dir: Optional[str], active: bool, keep_until_step: Optional[int] = None,
                 log_to=("jsonl",)):
        """``keep_until_step``: a resumed run keeps the records of steps ≤ it (the part of the
        interrupted run its checkpoint covers) and appends after them, so the file reads
        like one run; otherwise the file starts empty."""
        self.run_dir = run_dir if active else None
        self.jsonl = "jsonl" in log_to
        self.tb = None
        if self.run_dir:
            os.makedirs(self.run_dir, exist_ok=True)
        if self.run_dir and "tensorboard" in log_to:
            from torch.utils.tensorboard import SummaryWriter

            purge = keep_until_step + 1 if keep_until_step is not None else None
            self.tb = SummaryWriter(os.path.join(self.run_dir, "tb"), purge_step=purge)
        if self.run_dir and self.jsonl:
            self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
            self.ranks_path = os.path.join(self.run_dir, "ranks.jsonl")
            for path in (self.metrics_path, self.ranks_path):
                _start_jsonl(path, keep_until_step)

    def write_config(self, resolved: dict) -> None:
        if self.run_dir:
            import yaml

            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(resolved, f, sort_keys=False)

    def append(self, record: dict) -> None:
        """Append one line to metrics.jsonl (a disk error: :class:`~gridshard.errors.SaveError`, one line)."""
        if self.run_dir and self.jsonl:
            self._append_line(self.metrics_path, record)
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar("val/loss" if key == "val_loss" else f"train/{key}", value, record["step"])
            self.tb.flush()

    def append_ranks(self, record: dict) -> None:
        """Append one line to ranks.jsonl, the per-rank table of a log step (:mod:`gridshard.engine.rank_timing`)."""
        if self.run_dir and self.jsonl:
            self._append_line(self.ranks_path, record)

    def _append_line(self, path: str, record: dict) -> None:
        """Append ``record`` as one line of ``path`` (a disk error: :class:`~gridshard.errors.SaveError`)."""
        line = json.dumps(record) + "\n"
        try:
            with open(path, "a") as f:
                f.write(line)
        except OSError as e:
            from ..checkpoint.files import checkpoints_root, latest_or_none
            from ..disk import write_failure
            from ..errors import SaveError

            last = latest_or_none(checkpoints_root(self.run_dir))
            # one line for a failed write of a run file, or None when it is not a disk error
            why = write_failure(self.run_dir, path, e, f"the record of step {record.get('step')} "
                                f"was not appended to {os.path.basename(path)}", need=len(line),
                                need_what="the record", last=last)
            if why is None:
                raise
            raise SaveError(why) from e

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def format_postfix(rec: dict) -> dict:
    """Short fields for the progress bar."""
    out = {"loss": f"{rec['loss']:.4f}" if rec["loss"] is not None else "-", "lr": f"{rec['lr']:.2e}", "gnorm": f"{rec['grad_norm']:.3f}",
           "tok/s": f"{rec['tokens_per_s']:.0f}", "mem": f"{rec['peak_mem_bytes'] / 2**20:.0f}MiB",
           "comm": f"{rec['comm_share']:.0%}" if rec["comm_share"] is not None else "-"}
    if rec.get("mfu") is not None:
        out["mfu"] = f"{rec['mfu']:.1%}"
    if rec.get("moe_load_max") is not None:           # MoE: the worst layer's most-loaded expert / the mean
        out["moe_load"] = f"{rec['moe_load_max']:.2f}"
    return out
