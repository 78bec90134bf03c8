"""Mixed precision: bf16 autocast (CPU and GPU), fp16 autocast with loss scaling (GPU).

* ``fp32``: no autocast.
* ``bf16``: ``torch.autocast(device, bfloat16)``; parameters, gradients and the
  optimizer stay fp32 (bf16 has fp32's exponent range, so no loss scaling).
* ``fp16``: ``torch.autocast(cuda, float16)`` plus ``torch.amp.GradScaler``: the loss
  is multiplied by S before backward, gradients are divided by S before clipping,
  and a step whose gradients hold inf/NaN is skipped (S halves; it doubles after
  ``growth_interval`` clean steps).

One subtlety with sharded gradients: ``GradScaler`` decides "inf found" from the
gradients *this rank* holds. Under tensor parallelism an overflow may sit in one
rank's shard only; that rank would skip the step while the others take it, and the
replicas would silently diverge. :meth:`Precision.agree_on_overflow` therefore
replaces the per-rank verdict with the global one — the global gradient norm, which
is all-reduced over the tensor group and equal over data ranks, is finite or not
everywhere alike.
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, precision: str, device: torch.device):
        self.name, self.device = precision, device
        self.dtype = DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def agree_on_overflow(self, optimizer, global_norm: torch.Tensor) -> None:
        """Make the skip decision the same on every rank (module docstring)."""
        if self.scaler is None:
            return
        found = (~torch.isfinite(global_norm)).float()
        state = self.scaler._per_optimizer_states[id(optimizer)]
        for dev, t in state["found_inf_per_device"].items():
            t.copy_(found.to(t.device))

    def step(self, optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def loss_scale(self):
        return float(self.scaler.get_scale()) if self.scaler is not None else None
