"""``train.offload=optimizer``: AdamW's state and arithmetic in host memory.

:class:`HostAdamW` presents the device tensors (ZeRO shards, or whole blocks at ZeRO-0)
as its parameters — so gradient clipping and the fp16 loss scaler act on device
gradients as usual — and keeps, per tensor, an fp32 host copy with the two moments in
host memory (pinned on CUDA). ``step()``:

1. copy each device gradient to its host copy's ``.grad`` (device → host, s·4 bytes), all
   queued ``non_blocking`` into pinned staging buffers, then wait for one CUDA event recorded
   after the last copy (the current stream only, not a device-wide ``torch.cuda.synchronize``);
2. ``torch.optim.AdamW(fused=True).step`` on the host copies: one vectorised, multi-threaded
   pass per tensor (torch ≥ 2.4 has a fused CPU AdamW; the unfused step reads and writes each
   tensor ~10 times, single-tensor, in Python);
3. copy the updated host values back into the device tensors (host → device, s·4 bytes,
   ``non_blocking`` from pinned memory). The next step's event wait also covers these copies
   (same stream, in order) before the host writes the copies again.

Pinned (page-locked) buffers are what make ``non_blocking`` copies asynchronous and DMA-fast;
``torch.zeros_like`` of a pinned tensor is *not* pinned, so every host buffer (value and
gradient staging) is allocated with ``pin_memory=True`` explicitly when the device tensors are
on CUDA (:func:`pins_host_buffers`).

Device memory per parameter element drops from 16 bytes (fp32 value, gradient, two
moments) to 8 (value, gradient); host memory holds 12 (value, two moments) + 4 (gradient
staging). The result is torch's fused AdamW step on the host, bit for bit (tested on CPU);
against the fused CUDA AdamW a non-offloaded GPU run uses it agrees up to the devices'
rounding of the same formula (the fused CPU and unfused kernels also differ by ~1 ulp).

What only a GPU shows: that the copies overlap and the pinned buffers are really
page-locked (``tensor.is_pinned()``), and the step time against a non-offloaded run
(``benchmarks/gpu_check.sh`` check E). On CPU the offload is not used (``warn_offload_on_cpu``);
``tests/test_slow_paths.py`` checks, with CUDA faked, that every host buffer asks for pinned
memory and that a step waits on one event and never calls ``torch.cuda.synchronize``.

Hand-written because FSDP2's ``CPUOffloadPolicy`` offloads the *parameters* too and only
within ``fully_shard``; ZeRO here is :mod:`gridshard.zero.data_parallel`.
"""
from __future__ import annotations

import torch


def pins_host_buffers(params, host_device: torch.device) -> bool:
    """Whether host copies of ``params`` live in pinned memory: the host is the CPU, CUDA is
    present and some of ``params`` are on it (pinning is for device↔host copies only)."""
    return host_device.type == "cpu" and torch.cuda.is_available() and any(p.is_cuda for p in params)


class HostAdamW(torch.optim.Optimizer):
    """AdamW over ``param_groups`` of device tensors, computed on host copies (module docstring).
    ``host``: where the copies live (``cpu``; tests pass it on CPU to run the same path)."""

    def __init__(self, groups, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, host: str = "cpu"):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.host_device = torch.device(host)
        params = [p for g in self.param_groups for p in g["params"]]
        self.on_cuda = any(p.is_cuda for p in params)
        self.pinned = pins_host_buffers(params, self.host_device)
        self.copies, self.grad_staging = {}, {}
        for p in params:
            h = self.copies[p] = self._host_buffer(p.shape).copy_(p.detach())
            h.grad = self.grad_staging[p] = self._host_buffer(p.shape)
        host_groups = [{**g, "params": [self.copies[p] for p in g["params"]]} for g in self.param_groups]
        self.inner = torch.optim.AdamW(host_groups, lr=lr, betas=betas, eps=eps, fused=True)

    def _host_buffer(self, shape) -> torch.Tensor:
        """A zeroed fp32 host tensor, pinned when :func:`pins_host_buffers` says so."""
        return torch.zeros(shape, dtype=torch.float32, device=self.host_device, pin_memory=self.pinned)

    def state_for(self, tensor) -> dict:
        """The host AdamW state of device tensor ``tensor``."""
        host = self.copies.get(tensor)
        return None if host is None else self.inner.state.get(host)

    @torch.no_grad()
    def step(self, closure=None):
        for g, hg in zip(self.param_groups, self.inner.param_groups):
            hg["lr"], hg["weight_decay"], hg["betas"], hg["eps"] = g["lr"], g["weight_decay"], g["betas"], g["eps"]
            for p, h in zip(g["params"], hg["params"]):
                h.grad = None if p.grad is None else self.grad_staging[p].copy_(p.grad, non_blocking=True)
        if self.on_cuda and self.host_device.type == "cpu":
            copied = torch.cuda.Event()
            copied.record()
            copied.synchronize()          # the gradients (and last step's uploads) are on the host
        self.inner.step()
        for p, h in self.copies.items():
            p.copy_(h, non_blocking=True)
        return None

    @torch.no_grad()
    def reload_from_device(self) -> None:
        """Copy the device values into the host copies (after a checkpoint was read into them)."""
        for p, h in self.copies.items():
            h.copy_(p)
