"""AdamW over the local shards, with weight decay on matrices and embeddings only.

AdamW is element-wise, so stepping each rank's shard with the (complete) gradient of
that shard is exactly a step of the global model: no communication is needed. Whether
a parameter decays is read from its *global* shape (``shard_spec.global_shape``, else
its own shape): ≥ 2 dims decay (linear weights, embedding tables), 1-dim (norm weights,
biases) do not — the same choice at every layout.
"""
from __future__ import annotations

import torch

from ..nn.sharding import get_spec


def global_ndim(p: torch.Tensor) -> int:
    spec = get_spec(p)
    return len(spec.global_shape) if spec is not None else p.dim()


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    eps: float = 1e-8, tensors=None, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW with decay on parameters whose canonical tensor has ≥ 2 dims; a laid-out model's
    layouts (``model.parallel_context.layouts``) say which, else the shard spec or shape.

    ``tensors``: (parameter name, tensor) pairs to step instead of the parameters themselves
    (ZeRO: each parameter's elements in this rank's chunk, 1-dim views, :mod:`gridshard.zero`); the name picks the decay.
    ``offload``: keep AdamW's state and arithmetic in host memory (:class:`gridshard.zero.offload.HostAdamW`)."""
    ctx = getattr(model, "parallel_context", None)
    named_params = dict(model.named_parameters())
    if tensors is None:
        tensors = [(n, p) for n, p in named_params.items() if p.requires_grad]   # tied weights appear once
    decay, no_decay = [], []
    for name, t in tensors:
        ndim = len(ctx.layouts[name].canonical()) if ctx is not None else global_ndim(named_params[name])
        (decay if ndim >= 2 else no_decay).append(t)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if offload:
        from ..zero.offload import HostAdamW

        return HostAdamW(groups, lr=lr, betas=betas, eps=eps)
    fused = all(p.is_cuda for p in decay + no_decay) and len(decay + no_decay) > 0
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)
    moments = getattr(getattr(model, "grad_reducer", None), "adam_moments", None)
    if moments is not None:
        seed_adam_state(optimizer, moments)
    return optimizer


def seed_adam_state(optimizer: torch.optim.Optimizer, moments) -> None:
    """Give each stepped tensor ``t`` for which ``moments(t)`` names memory — (exp_avg,
    exp_avg_sq), zero views of a ZeRO-3 reducer's arena on CPU (:mod:`gridshard.zero.pages`) —
    its AdamW state before the first step, in the form ``torch.optim.AdamW`` makes (``step`` a
    0-dim fp32 tensor, 0): AdamW then never allocates the moments itself (it only fills empty
    state), and a checkpoint load copies into them (:func:`gridshard.checkpoint.blocks.ensure_adam_state`
    leaves present state alone)."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            got = moments(p)
            if got is None or optimizer.state[p] or group.get("amsgrad"):
                continue
            step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else torch.device("cpu"))
            optimizer.state[p].update(step=step, exp_avg=got[0], exp_avg_sq=got[1])


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
