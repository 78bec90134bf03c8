"""Learning-rate schedule: linear warm-up, then cosine (or constant) decay to ``min_lr``.

For optimizer step k = 0, 1, … (W warm-up steps, decay ending at step K)::

    lr(k) = lr · (k+1)/W                                   k < W
    lr(k) = min_lr + ½(lr − min_lr)(1 + cos(π·p)),          p = min(1, (k−W)/max(1, K−W))
    lr(k) = lr                                              schedule = constant, k ≥ W

One function read by the step (``engine/step.py``) and by the resume rules
(``checkpoint/resume.py``, which refuse a config that changes the rate of a step still to run);
it imports nothing, so both read it without an import cycle.
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
          schedule: str = "cosine") -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
