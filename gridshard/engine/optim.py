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
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with decay on parameters whose canonical tensor has ≥ 2 dims; a laid-out model's
    layouts (``model.parallel_context.layouts``) say which, else the shard spec or shape."""
    ctx = getattr(model, "parallel_context", None)
    decay, no_decay = [], []
    for name, p in model.named_parameters():            # tied weights appear once
        if p.requires_grad:
            ndim = len(ctx.layouts[name].canonical()) if ctx is not None else global_ndim(p)
            (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay) and len(decay + no_decay) > 0
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
