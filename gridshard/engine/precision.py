"""Mixed precision: bf16 autocast (CPU and GPU), fp16 autocast with loss scaling (GPU).

* ``fp32``: no autocast.
* ``bf16``: ``torch.autocast(device, bfloat16)``; parameters and gradients stored in bf16,
  fp32 master weights (and AdamW on them) owned by the gradient reducer
  (:func:`gridshard.zero.reducer.build_reducer`, ``train.grad_reduce_dtype``); bf16 has fp32's
  exponent range, so no loss scaling.
* ``fp16``: fp32 parameters, ``torch.autocast(cuda, float16)`` plus ``torch.amp.GradScaler``: the loss
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


def apply_math_modes(precision: str, tf32: bool, deterministic: bool, device: torch.device) -> dict:
    """Set PyTorch's process-wide math switches from the config, once, when the job is built
    (:func:`gridshard.engine.job.build_job`); returns what is in effect.

    * ``train.tf32`` (on CUDA, fp32 runs only): fp32 matmuls on TF32 tensor cores —
      ``torch.set_float32_matmul_precision("high")`` (``"highest"`` otherwise) and
      ``torch.backends.cudnn.allow_tf32``. TF32 keeps fp32's range with a 10-bit mantissa
      (relative rounding ≈ 2⁻¹¹ per product, accumulation in fp32). bf16/fp16 runs compute their
      matmuls in those types under autocast and leave both switches ``"highest"``/off; on the
      CPU nothing is touched.
    * ``train.deterministic``: ``torch.use_deterministic_algorithms(deterministic)`` on every
      device (so a worker reused for a later job does not keep an earlier job's setting). On CUDA
      cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before its first call: set here when
      unset; set it in the launch environment to be sure.
    """
    on_cuda = device.type == "cuda"
    modes = {"tf32": on_cuda and tf32 and precision == "fp32", "deterministic": bool(deterministic)}
    if on_cuda:
        torch.set_float32_matmul_precision("high" if modes["tf32"] else "highest")
        torch.backends.cudnn.allow_tf32 = modes["tf32"]
        if deterministic:
            import os

            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(modes["deterministic"])
    return modes


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the parameters (and their gradients) are stored in under ``train.precision``: bf16 for
    ``bf16`` (the reducer keeps fp32 masters), fp32 otherwise (module docstring)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


class Precision:
    def __init__(self, precision: str, device: torch.device):
        self.name, self.device = precision, device
        self.dtype = DTYPES[precision]                 # the compute dtype (autocast's)
        self.param_dtype = param_dtype(precision)
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
        for t in self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            t.copy_(found.to(t.device))

    def step(self, optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def loss_scale(self):
        return float(self.scaler.get_scale()) if self.scaler is not None else None
