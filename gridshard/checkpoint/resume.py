"""Which checkpoint a run resumes from, and whether its config may continue it.

``train.resume``: ``never`` (default), ``auto`` (the run directory's ``latest`` complete
checkpoint if there is one, else a fresh start — what an elastic restart uses) or a path
(a ``step_N`` folder, a ``checkpoints`` folder or a run directory).

What may change on resume: the world size and the whole layout (D, P, T, 1D ↔ 2D, ±SP),
the micro-batch, ZeRO, recompute, logging and checkpoint settings — the trajectory is a
function of the global model, the global batch of each step, the optimizer and the
learning rate of each step only. Changes of the data source or the seed are allowed too,
and logged (they change which batches follow), as are changes of the optimizer's other
hyper-parameters and the precision.

What may not:

* the model (any field but ``preset``, ``init_from``, ``hf_config``: the weights continue);
* ``train.global_batch`` and ``data.seq_len`` (the data position is a global sample count:
  step·G sequences of s tokens);
* the learning rate of the steps still to run, unless ``train.allow_changed_schedule`` is
  true (``gridshard train --allow-changed-schedule`` sets it): then the change is accepted
  and named in the resume log line.

The schedule rule, precisely. Step k runs at
``lr_at(k, lr, min_lr, warmup_steps, decay_steps or steps, schedule)``
(:func:`gridshard.schedule.lr_at`; the trainer's horizon is ``train.decay_steps``,
or ``train.steps`` when it is unset). A resume at step k₀ runs steps k₀ … steps−1; it is
refused when one of them gets another learning rate than the checkpoint's config gives it
(the saved schedule extended past its own end, where it stays at its last value). So
``lr``, ``warmup_steps`` and ``schedule`` changes are refused, and so is a new ``steps``
when ``decay_steps`` is unset and the decay is cosine (the decay would end elsewhere:
``train.decay_steps=<old steps>`` trains longer on the same schedule, at ``min_lr`` after
its end); ``min_lr`` or ``decay_steps`` under ``schedule: constant``, or ``steps`` with an
explicit ``decay_steps``, change nothing and are only logged.

Every problem is reported in one :class:`~gridshard.checkpoint.files.CheckpointError`:
each field with both values, then one Fix.
"""
from __future__ import annotations

import os
from typing import Optional

from ..schedule import lr_at
from . import files as F

FIXED_FIELDS = (("train", "global_batch"), ("data", "seq_len"))
LOGGED_FIELDS = (("data", "kind"), ("data", "path"), ("train", "seed"), ("train", "micro_batch"), ("train", "zero"),
                 ("train", "recompute"), ("train", "offload"), ("train", "weight_decay"), ("train", "beta1"),
                 ("train", "beta2"), ("train", "adam_eps"), ("train", "grad_clip"), ("train", "precision"),
                 ("train", "grad_reduce_dtype"))
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "schedule", "decay_steps", "steps")
ALLOW_KEY = "allow_changed_schedule"
ALLOW_FLAG = "--allow-changed-schedule"
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


def _schedule_of(train: dict, fallback: dict) -> tuple:
    """(lr, min_lr, warmup_steps, decay horizon, schedule) as the trainer uses them."""
    def get(key):
        return train.get(key, fallback.get(key))

    return (get("lr"), get("min_lr"), get("warmup_steps"), get("decay_steps") or get("steps"), get("schedule"))


def schedule_differs(saved_train: dict, current_train: dict, start_step: int = 0) -> bool:
    """Whether a step in ``start_step`` … ``current steps``−1 gets another learning rate under
    ``current_train`` than under ``saved_train`` (module docstring). Exact: the parameters are
    compared first, the steps one by one only when they differ (stopping at the first
    difference, normally the first step)."""
    old, new = _schedule_of(saved_train, current_train), _schedule_of(current_train, saved_train)
    if old == new:
        return False
    return any(lr_at(k, *old) != lr_at(k, *new) for k in range(int(start_step), int(current_train["steps"])))


def _yaml(value) -> str:
    """``value`` as an override writes it (``key=VALUE``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _schedule_keys(st: dict, ct: dict) -> list:
    """The schedule keys whose change makes the schedules differ (``steps`` only as the decay's
    end, i.e. when neither side sets ``decay_steps``)."""
    keys = [k for k in SCHEDULE_FIELDS if k in st and st.get(k) != ct.get(k)]
    if "steps" in keys and (st.get("decay_steps") or ct.get("decay_steps")) and len(keys) > 1:
        keys.remove("steps")
    return keys


def _get(config: dict, section: str, key: str):
    return config.get(section, {}).get(key)


def check_compatible(saved: dict, current: dict, where: str, start_step: Optional[int] = None) -> list:
    """Refuse a resume whose model, global batch, sequence length or (unless
    ``train.allow_changed_schedule``) learning-rate schedule differ from the checkpoint's
    config ``saved``: one CheckpointError naming every differing field with both values, and
    one fix (module docstring). ``start_step``: the checkpoint's step (the schedule is compared
    on the steps still to run; None: from step 0). Returns the accepted changes, for the log."""
    sm, cm = saved.get("model", {}), current.get("model", {})
    st, ct = saved.get("train", {}), current.get("train", {})
    start = 0 if start_step is None else int(start_step)
    model = [("model", k) for k in sorted(set(sm) | set(cm)) if k not in _MODEL_IGNORED and sm.get(k) != cm.get(k)]
    fixed = [(s, k) for s, k in FIXED_FIELDS if _get(saved, s, k) != _get(current, s, k)]
    schedule = [("train", k) for k in _schedule_keys(st, ct)] if schedule_differs(st, ct, start) else []
    refused_schedule = [] if ct.get(ALLOW_KEY) else schedule
    refused = model + fixed + refused_schedule
    if refused:
        fields = "; ".join(f"{s}.{k} is {_get(current, s, k)!r} in this config but {_get(saved, s, k)!r} in the "
                           f"checkpoint" for s, k in refused)
        rules = [text for text, broken in (
            ("the model must stay the same (its weights continue)", model),
            ("train.global_batch and data.seq_len fix which data each step reads", fixed),
            (f"the schedule would give the steps after step {start} another learning rate than the run it continues"
             + (" (train.decay_steps is unset: the cosine decay ends at train.steps)"
                if ("train", "steps") in schedule else ""), refused_schedule)) if broken]
        rule = "; ".join(rules)
        fix = [f"set {' '.join(f'{s}.{k}={_yaml(_get(saved, s, k))}' for s, k in refused)}"]
        if refused_schedule:
            fix.append(f"pass {ALLOW_FLAG} (train.{ALLOW_KEY}=true) to continue with the new schedule"
                       + (" (the rest must still match)" if model or fixed else ""))
            if ("train", "steps") in schedule:
                fix.append(f"set train.decay_steps={st.get('steps')} to change train.steps on the same schedule")
        if not model:
            fix.append("start a new run from its weights with model.init_from=PATH")
        n = len(refused)
        raise F.CheckpointError(
            f"cannot resume from {where}: {n} field{'s' if n > 1 else ''} differ{'' if n > 1 else 's'} from the "
            f"checkpoint: {fields}. {rule[0].upper() + rule[1:]} (the layout, micro_batch, logging and checkpoint "
            f"settings may change). Fix: {', or '.join(fix)}.")
    changes = []
    for section, key in [("parallel", k) for k in saved.get("parallel", {})] + list(LOGGED_FIELDS):
        a, b = _get(saved, section, key), _get(current, section, key)
        if a != b:
            changes.append(f"{section}.{key}: {a!r} -> {b!r}")
    for key in SCHEDULE_FIELDS:
        if key in st and st.get(key) != ct.get(key):
            allowed = f" (a new schedule, {ALLOW_FLAG})" if ("train", key) in schedule else ""
            changes.append(f"train.{key}: {st.get(key)!r} -> {ct.get(key)!r}{allowed}")
    return changes


def describe(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))
