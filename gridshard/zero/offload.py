"""``train.offload=optimizer``: AdamW's state and arithmetic in host memory.

:class:`HostAdamW` presents the device tensors (ZeRO shards, or whole blocks at ZeRO-0)
as its parameters — so gradient clipping and the fp16 loss scaler act on device
gradients as usual — and keeps, per tensor, an fp32 host copy with the two moments in
host memory (pinned on CUDA). ``step()``:

1. copy each device gradient to its host copy's ``.grad`` (device → host, s·4 bytes);
2. ``torch.optim.AdamW.step`` on the host copies (the CPU does the arithmetic);
3. copy the updated host values back into the device tensors (host → device, s·4 bytes).

Device memory per parameter element drops from 16 bytes (fp32 value, gradient, two
moments) to 8 (value, gradient); host memory holds 12 (value, two moments) + 4 (gradient
staging). The result is the same AdamW step bit for bit when host and device compute in
fp32 alike (exact on CPU; on GPUs up to the devices' rounding of the same formula).

Hand-written because FSDP2's ``CPUOffloadPolicy`` offloads the *parameters* too and only
within ``fully_shard``; ZeRO here is :mod:`gridshard.zero.data_parallel`.
"""
from __future__ import annotations

import torch


class HostAdamW(torch.optim.Optimizer):
    """AdamW over ``param_groups`` of device tensors, computed on host copies (module docstring).
    ``host``: where the copies live (``cpu``; tests pass it on CPU to run the same path)."""

    def __init__(self, groups, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, host: str = "cpu"):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.host_device = torch.device(host)
        pin = torch.cuda.is_available() and self.host_device.type == "cpu" and any(
            p.is_cuda for g in self.param_groups for p in g["params"])
        self.copies = {}
        host_groups = []
        for g in self.param_groups:
            hs = []
            for p in g["params"]:
                h = torch.empty(p.shape, dtype=torch.float32, device=self.host_device, pin_memory=pin)
                h.copy_(p.detach())
                h.grad = torch.zeros_like(h)
                self.copies[p] = h
                hs.append(h)
            host_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hs})
        self.inner = torch.optim.AdamW(host_groups, lr=lr, betas=betas, eps=eps)

    def state_for(self, tensor) -> dict:
        """The host AdamW state of device tensor ``tensor``."""
        host = self.copies.get(tensor)
        return None if host is None else self.inner.state.get(host)

    @torch.no_grad()
    def step(self, closure=None):
        for g, hg in zip(self.param_groups, self.inner.param_groups):
            hg["lr"], hg["weight_decay"], hg["betas"], hg["eps"] = g["lr"], g["weight_decay"], g["betas"], g["eps"]
            for p, h in zip(g["params"], hg["params"]):
                if p.grad is None:
                    h.grad = None
                else:
                    if h.grad is None:
                        h.grad = torch.zeros_like(h)
                    h.grad.copy_(p.grad, non_blocking=True)
        if self.host_device.type == "cpu" and any(p.is_cuda for p in self.copies):
            torch.cuda.synchronize()
        self.inner.step()
        for p, h in self.copies.items():
            p.copy_(h, non_blocking=True)
        return None

    @torch.no_grad()
    def reload_from_device(self) -> None:
        """Copy the device values into the host copies (after a checkpoint was read into them)."""
        for p, h in self.copies.items():
            h.copy_(p)
