"""SwiGLU's product silu(g)·u keeping only g and u for backward (the dense Llama's MLP and the MoE
experts): silu(g) is computed again from g in backward, as Megatron's fused ``bias_swiglu`` does, so
``train.recompute: none`` keeps the published accounting (issue 43)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    """silu(g)·u keeping g and u for backward, not silu(g): the backward computes silu(g) again from
    g (Megatron's fused ``bias_swiglu`` keeps the same two). The ops are the ones autograd runs for
    ``F.silu(g) * u`` (mul's backward: grad·u and grad·silu(g); silu's: ``aten.silu_backward``), so
    the gradients are that expression's bit for bit; no RNG, no checkpoint region."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad[:2]
        grad_up = grad * F.silu(gate) if need_up else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if need_gate else None
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up, keeping gate and up for backward and rebuilding silu(gate) there
    (:class:`_SwiGLU`); operands of different shapes or dtypes (broadcasting, promotion) take the
    plain expression, which keeps silu(gate) too."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


__all__ = ["swiglu"]
