"""Which checkpoint a run resumes from, and whether its config may continue it.

``train.resume``: ``never`` (default), ``auto`` (the run directory's ``latest`` complete
checkpoint if there is one, else a fresh start — what an elastic restart uses) or a path
(a ``step_N`` folder, a ``checkpoints`` folder or a run directory).

What may change on resume: the world size and the whole layout (D, P, T, 1D ↔ 2D, ±SP),
the micro-batch, the number of steps, logging and checkpoint settings — the trajectory
is a function of the global model, the global batch of each step and the step count only
(changes of the data source or the seed are allowed too, and logged: they change which
batches follow).
What may not: the model (any dimension, tied embeddings), ``train.global_batch`` and
``data.seq_len`` (the data position is a global sample count: step·G sequences of s
tokens). Those are refused with the differing field named.
"""
from __future__ import annotations

import os
from typing import Optional

from . import files as F

FIXED_FIELDS = (("train", "global_batch"), ("data", "seq_len"))
LOGGED_FIELDS = (("data", "kind"), ("data", "path"), ("train", "seed"), ("train", "micro_batch"), ("train", "zero"),
                 ("train", "recompute"), ("train", "offload"))
_MODEL_IGNORED = ("preset", "init_from", "hf_config")


def resume_folder(resume: str, run_dir: Optional[str]) -> Optional[str]:
    """The checkpoint folder ``train.resume`` names, or None for a fresh start."""
    if resume == "never":
        return None
    if resume == "auto":
        if not run_dir:
            return None
        return F.read_latest(F.checkpoints_root(run_dir))
    return F.resolve_checkpoint(resume, run_dir)


def check_compatible(saved: dict, current: dict, where: str) -> list:
    """Refuse a resume whose model, global batch or data differ (CheckpointError naming the
    field, both values and a fix); return the layout changes (for the log)."""
    sm, cm = saved.get("model", {}), current.get("model", {})
    for key in sorted(set(sm) | set(cm)):
        if key in _MODEL_IGNORED:
            continue
        if sm.get(key) != cm.get(key):
            raise F.CheckpointError(f"cannot resume from {where}: model.{key} is {cm.get(key)!r} in this config but "
                                    f"{sm.get(key)!r} in the checkpoint. The model must stay the same. Fix: set "
                                    f"model.{key}={sm.get(key)!r}, or start from its weights only with "
                                    f"model.init_from=PATH.")
    for section, key in FIXED_FIELDS:
        a, b = saved.get(section, {}).get(key), current.get(section, {}).get(key)
        if a != b:
            raise F.CheckpointError(f"cannot resume from {where}: {section}.{key} is {b!r} in this config but {a!r} in "
                                    f"the checkpoint; it fixes which data each step reads. Fix: set "
                                    f"{section}.{key}={a!r} (the layout, micro_batch and steps may change).")
    changes = []
    fields = [("parallel", k) for k in saved.get("parallel", {})] + list(LOGGED_FIELDS)
    for section, key in fields:
        a, b = saved.get(section, {}).get(key), current.get(section, {}).get(key)
        if a != b:
            changes.append(f"{section}.{key}: {a!r} -> {b!r}")
    return changes


def describe(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))
