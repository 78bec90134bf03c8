"""The Mixture-of-Experts block that replaces a decoder layer's MLP: route, dispatch, compute,
combine, on one device (the expert-parallel dispatch between ranks builds on these pieces).

For x [b, s, h] (N = b·s tokens) with n experts, k per token:

1. route (:class:`gridshard.moe.routing.Router`): per token the experts e_1..e_k and weights
   g_1..g_k, a slot past its expert's capacity dropped (g = 0);
2. dispatch: the N·k slots sorted by expert (stable: token order within an expert), the kept
   slots' token rows gathered into x_sorted [M, h], M ≤ N·k, with c_e rows for expert e;
3. compute: x_sorted through the experts as grouped products (:mod:`gridshard.moe.experts`);
4. combine: each result put back at its slot, y_t = Σ_j g_j · expert_{e_j}(x_t), summed over the
   k slots of token t in a fixed order (no scatter-add: the same bits on every run);
5. shared experts (``shared_ffn`` > 0): one always-on SwiGLU MLP of width ``shared_ffn`` added,
   y_t += shared(x_t) (DeepSeek's and Qwen2-MoE's shared experts, as one wider MLP).

The auxiliary loss α·Σ_b L_b / B (:func:`gridshard.moe.routing.sequence_aux_loss`) reaches the
gradients without changing any loss plumbing: the block's output passes through
:class:`_AuxLossGradient`, an identity whose backward also gives Σ_b L_b the gradient
``aux_weight`` = α/B (Megatron-core attaches its aux loss the same way). ``aux_weight`` is set by
the trainer from the step's sequence count B; left None, B is this call's b (the standalone mean).

Statistics of the calls since :meth:`MoEBlock.reset_stats` (buffers, not saved): ``aux_sum``
Σ_b L_b, ``load`` [n] kept slots per expert, ``slots`` and ``dropped`` token-slots. A forward that
runs inside backward (``train.recompute: full`` recomputing the layer, ``torch._C.
_current_graph_task_id() != -1``: PyTorch has no public test for it) is not counted again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .experts import Experts
from .routing import Router, sequence_aux_loss


class _AuxLossGradient(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient, and ``weight`` for ``aux``."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out.new_full((), ctx.weight, dtype=torch.float32), None


class MoEBlock(nn.Module):
    """``gate`` (the :class:`Router`, named as Hugging Face names it), ``experts``
    (:class:`Experts`), and ``shared_experts`` (an :class:`Experts` of one, width ``shared_ffn``)
    when ``shared_ffn`` > 0."""

    #: the statistics buffers (module docstring), zeros of these dtypes and shapes ([n] for load)
    STATS = (("aux_sum", torch.float32), ("load", torch.long), ("slots", torch.long), ("dropped", torch.long))

    #: ``gridshard.parallelize`` does not apply a dense MLP's plan entries to it (it sits where a
    #: dense decoder has its MLP, under the same name)
    laid_out_whole = True

    def __init__(self, hidden: int, n_experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0,
                 score: str = "softmax", normalize: bool = True, capacity: Optional[float] = None,
                 aux_coefficient: float = 0.0):
        super().__init__()
        self.n_experts, self.top_k, self.aux_coefficient = n_experts, top_k, aux_coefficient
        self.aux_weight: Optional[float] = None
        self.gate = Router(hidden, n_experts, top_k, score, normalize, capacity)
        self.experts = Experts(n_experts, hidden, expert_ffn)
        self.shared_experts = Experts(1, hidden, shared_ffn) if shared_ffn else None
        self.reset_buffers(None)

    def reset_buffers(self, device) -> None:
        """The statistics, zeroed, on ``device`` (``gridshard.parallelize`` builds on meta)."""
        for name, dtype in self.STATS:
            shape = (self.n_experts,) if name == "load" else ()
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def reset_stats(self) -> None:
        for name, _ in self.STATS:
            getattr(self, name).zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        routing = self.gate(flat, s)
        slot_expert = routing.experts.flatten()
        kept = routing.kept.flatten().nonzero().squeeze(1)
        order = kept[torch.argsort(slot_expert[kept], stable=True)]             # kept slots, by expert
        load = torch.bincount(slot_expert[order], minlength=self.n_experts)
        y_sorted = self.experts(flat[order // self.top_k], load.tolist())
        y_slots = y_sorted.new_zeros(b * s * self.top_k, h).index_put((order,), y_sorted)
        y = (y_slots.view(b * s, self.top_k, h) * routing.weights.unsqueeze(-1).to(y_slots.dtype)).sum(1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, [b * s])
        aux = sequence_aux_loss(routing, self.n_experts, s)
        if torch._C._current_graph_task_id() == -1:        # not full recompute's second forward, in backward
            self._count(aux.detach(), load, routing)
        y = y.view(b, s, h).to(x.dtype)
        if self.aux_coefficient and torch.is_grad_enabled():
            weight = self.aux_weight if self.aux_weight is not None else self.aux_coefficient / b
            y = _AuxLossGradient.apply(y, aux, weight)
        return y

    @torch.no_grad()
    def _count(self, aux, load, routing) -> None:
        self.aux_sum += aux
        self.load += load
        self.slots += routing.kept.numel()
        self.dropped += routing.kept.numel() - routing.kept.sum()
