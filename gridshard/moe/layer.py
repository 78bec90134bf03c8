"""The Mixture-of-Experts block that replaces a decoder layer's MLP: route, dispatch, compute,
combine — on one rank, or with its experts split over E expert ranks (:meth:`MoEBlock.split_experts`,
the exchange in :mod:`gridshard.moe.dispatch`).

For x [b, s, h] (N = b·s tokens) with n experts, k per token:

1. route (:class:`gridshard.moe.routing.Router`): per token the experts e_1..e_k and weights
   g_1..g_k, a slot past its expert's capacity dropped (g = 0);
2. dispatch: the N·k slots sorted by expert (stable: token order within an expert), the kept
   slots' token rows gathered into x_sorted [M, h], M ≤ N·k, with c_e rows for expert e (E > 1:
   sent to the rank holding expert e);
3. compute: x_sorted through the experts as grouped products (:mod:`gridshard.moe.experts`);
4. combine: each result (E > 1: sent back) put back at its slot, y_t = Σ_j g_j · expert_{e_j}(x_t),
   summed over the k slots of token t in a fixed order (no scatter-add: the same bits on every run);
5. shared experts (``shared_ffn`` > 0): one always-on SwiGLU MLP of width ``shared_ffn`` added,
   y_t += shared(x_t) (DeepSeek's shared experts, as one wider MLP; Qwen2-MoE's gated one is
   :meth:`MoEBlock.attach_shared`).

The auxiliary loss α·Σ_b L_b / B (:func:`gridshard.moe.routing.sequence_aux_loss`) reaches the
gradients without changing any loss plumbing: the block's output passes through
:class:`_AuxLossGradient`, an identity whose backward also gives Σ_b L_b the gradient
``aux_weight`` = α/B (Megatron-core attaches its aux loss the same way). ``aux_weight`` is set by
the trainer from the step's sequence count B; left None, B is this call's b (the standalone mean).

Statistics of the calls since :meth:`MoEBlock.reset_stats` (buffers, not saved): ``aux_sum``
Σ_b L_b, ``load`` [n] kept slots per expert, ``slots`` and ``dropped`` token-slots. A forward that
runs inside backward (``train.recompute: full`` recomputing the layer,
:func:`gridshard.torch_private.in_backward`: PyTorch has no public test for it) is not counted again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..comm.dual_ops import gather_from_group, scatter_to_group
from ..errors import LayoutError
from ..nn.sharding import ShardSpec, set_spec
from ..torch_private import in_backward
from .dispatch import ExpertDispatch, combine, sort_slots
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
    when ``shared_ffn`` > 0; ``layer``: the index of the decoder layer it sits in."""

    #: the statistics buffers (module docstring), zeros of these dtypes and shapes ([n] for load)
    STATS = (("aux_sum", torch.float32), ("load", torch.long), ("slots", torch.long), ("dropped", torch.long))

    #: ``gridshard.parallelize`` does not apply a dense MLP's plan entries to it (it sits where a
    #: dense decoder has its MLP, under the same name)
    laid_out_whole = True

    def __init__(self, hidden: int, n_experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0,
                 score: str = "softmax", normalize: bool = True, capacity: Optional[float] = None,
                 aux_coefficient: float = 0.0, layer: int = 0):
        super().__init__()
        self.n_experts, self.top_k, self.aux_coefficient = n_experts, top_k, aux_coefficient
        self.layer = layer                                    # the decoder layer's index (statistics' row)
        self.aux_weight: Optional[float] = None
        self.gate = Router(hidden, n_experts, top_k, score, normalize, capacity)
        self.experts = Experts(n_experts, hidden, expert_ffn)
        self.shared_experts = Experts(1, hidden, shared_ffn) if shared_ffn else None
        self.shared_expert: Optional[nn.Module] = None      # a gated shared expert (Qwen2-MoE): attach_shared
        self.shared_expert_gate: Optional[nn.Module] = None
        self.dispatch: Optional[ExpertDispatch] = None      # E > 1: the exchange over the expert ranks
        self.token_gathers: tuple = ()                      # T > 1: the residual block → the whole micro-batch
        self.reset_buffers(None)

    def split_experts(self, axis, kind: str) -> None:
        """Expert parallelism over ``axis`` (``mesh.expert``, E ranks): keep the n/E experts of this
        expert rank (meta blocks with the ``expert`` split, which ``gridshard.parallelize``
        materialises) and exchange the slots by ``kind`` (``parallel.expert_dispatch``)."""
        if self.n_experts % axis.size:
            raise LayoutError(f"parallelize: experts={self.n_experts} is not divisible by parallel.expert="
                              f"{axis.size}: every expert rank holds the same number of experts. Fix: choose "
                              f"parallel.expert among the divisors of {self.n_experts}.")
        for name, p in list(self.experts.named_parameters(recurse=False)):
            spec = ShardSpec(tuple(p.shape), ((0, "expert"),))
            local = torch.empty(spec.local_shape({"expert": axis.size}), dtype=p.dtype, device="meta")
            setattr(self.experts, name, set_spec(nn.Parameter(local, requires_grad=p.requires_grad), spec))
        self.experts.n_experts = self.n_experts // axis.size
        self.dispatch = ExpertDispatch(axis, self.n_experts, kind)

    def reset_buffers(self, device) -> None:
        """The statistics, zeroed, on ``device`` (``gridshard.parallelize`` builds on meta)."""
        for name, dtype in self.STATS:
            shape = (self.n_experts,) if name == "load" else ()
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def reset_stats(self) -> None:
        for name, _ in self.STATS:
            getattr(self, name).zero_()

    def attach_shared(self, expert: nn.Module, gate: nn.Module) -> None:
        """Qwen2-MoE's shared expert, gated per token: y_t += σ(gate(x_t)) · expert(x_t) (``expert`` an
        MLP [N, h] → [N, h], ``gate`` a Linear h → 1; Hugging Face's own modules, under its names)."""
        self.shared_expert, self.shared_expert_gate = expert, gate

    def tokens_over(self, gathers: tuple) -> None:
        """Tensor parallelism: the block gets a rank's block of the residual stream and runs on the whole
        micro-batch, the same on every tensor rank (``gathers``: the scheme's
        :meth:`~gridshard.tensor_scheme.TensorScheme.token_gathers`). Each gather is forward all-gather,
        backward keep my block; on the way out each is undone, forward keep my block, backward
        all-gather: inside, every tensor rank holds the same values and whole gradients, so its
        parameters (replicated over tensor ranks) get whole gradients with no tensor reduction, and
        the aux loss and statistics count every token once (they are summed over data ranks, not
        tensor ranks). The experts' FLOPs are repeated on the T tensor ranks (docs/moe.md)."""
        self.token_gathers = tuple(gathers)

    def sequences_over(self, axis) -> None:
        """Context parallelism: each sequence lies on the C ranks of ``axis`` (chunks i and 2C − 1 − i
        here); its aux loss and capacity are counted over the whole sequence
        (:mod:`gridshard.moe.routing`), and each of the C ranks counts 1/C of the identical Σ_b L_b in
        the statistics."""
        self.gate.sequence_axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for axis, dim in self.token_gathers:
            x = gather_from_group(x, axis, dim)
        y = self._whole(x)
        for axis, dim in reversed(self.token_gathers):
            y = scatter_to_group(y, axis, dim)
        return y

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        routing = self.gate(flat, s)
        if self.dispatch is not None:
            y, load = self.dispatch(flat, routing, self.experts)
        else:
            order, load = sort_slots(routing, self.n_experts)
            y = combine(self.experts(flat[order // self.top_k], load.tolist()), order, routing.weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, [b * s])
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        axis = self.gate.sequence_axis
        aux = sequence_aux_loss(routing, self.n_experts, s, axis)
        if not in_backward():                            # not full recompute's second forward, in backward
            self._count(aux.detach() / (axis.size if axis is not None else 1), load, routing)
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
