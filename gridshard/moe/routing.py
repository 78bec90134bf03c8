"""Top-k routing of a Mixture-of-Experts layer: scores, selection, load balancing, capacity.

For the N tokens x [N, h] of a micro-batch and n experts, the router's weight W_r [n, h] gives

    z = x·W_rᵀ (in fp32),    p = softmax(z)  (``score="softmax"``)  or  σ(z)  (``score="sigmoid"``)

Selection takes the k experts of largest p + β per token, where β [n] is the balancing bias
(DeepSeek-V3's auxiliary-loss-free balancing): it steers *which* experts are chosen, never how
much they count. The combine weights are the unbiased scores of the chosen experts, g = p[chosen],
divided by their sum when ``normalize`` (Mixtral, Qwen3-MoE, DeepSeek-V3) and kept as they are
otherwise (Qwen2-MoE's default).

**Auxiliary load-balancing loss** (the Switch/GShard form, scaled as Megatron-core and
DeepSeek-V3 do so that a perfectly balanced router scores 1), per *sequence* b of S tokens:

    f_{b,e} = n/(k·S) · #{(s, j): chosen[b, s, j] = e},      P_{b,e} = 1/S · Σ_s p̂_{b,s,e}
    L_b = Σ_e f_{b,e} · P_{b,e}

with p̂ the scores normalised to sum 1 per token (the softmax already does; sigmoid scores are
divided by their sum). Counted per sequence, every term depends on one sequence's tokens only,
so the sum Σ_b L_b over a step's sequences is the same however the batch is split over data
ranks or micro-batches; the step's aux loss is α · Σ_b L_b / B over its B sequences
(:func:`sequence_aux_loss` gives Σ_b L_b). f counts the slots before any capacity drop (the
router's choice is what the loss balances).

**Capacity** (``capacity`` = c, None: dropless). Each expert takes at most ⌈c·k·S/n⌉ token-slots
of each sequence; the slots of a sequence are offered in token order, and within a token in the
order of its choices (largest score first). A slot past its expert's capacity is dropped: it
adds nothing to the token's output, and is counted (``MoEBlock.dropped``). Per sequence, the
drops, like the loss, do not depend on the layout.

**Context parallelism** (``sequence_axis``: C context ranks, rank i holding chunks i and
2C − 1 − i of every sequence, docs/context.md). A sequence's S tokens lie on C ranks, so both
per-sequence sums are completed over them: the aux loss all-reduces each sequence's slot counts
(no gradient) and score sums (forward all-reduce, backward identity: each rank's scores get the
gradient of the one L_b every rank then holds) before the product; capacity all-gathers each
rank's per-chunk slot counts, and a chunk's running counts start from the counts of the chunks
before it in sequence order. Drops and L_b are those of the whole sequence on one rank.

**Balancing bias** update (``train.moe_bias_rate`` u, after each optimizer step, from the step's
token-slot counts c_e over all its micro-batches): β_e ← β_e + u·sign(c̄ − c_e), c̄ their mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import collectives as C
from ..comm.dual_ops import reduce_from_group

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One call's routing of N = b·s tokens: ``experts`` [N, k] (int64, the chosen experts, best
    first), ``weights`` [N, k] (their combine weights; 0 for a dropped slot), ``kept`` [N, k]
    (bool; all True when dropless), ``scores`` [N, n] (p̂, fp32, for the aux loss)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    scores: torch.Tensor


class Router(nn.Module):
    """``weight`` [n, h] (a parameter, like Hugging Face's ``gate.weight``) and the balancing bias
    ``expert_bias`` [n] (a buffer; zeros unless the bias update runs)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, score: str = "softmax", normalize: bool = True,
                 capacity: Optional[float] = None):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"router score={score!r} is not one of {SCORES}")
        self.n_experts, self.top_k, self.score, self.normalize, self.capacity = \
            n_experts, top_k, score, normalize, capacity
        self.sequence_axis = None               # context parallelism: the C ranks a sequence lies on
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        # in the state dict, so checkpoints carry it (gridshard.checkpoint.blocks.buffer_blocks)
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def reset_buffers(self, device) -> None:
        """The balancing bias at its start, zeros, on ``device`` (``gridshard.parallelize`` builds on meta)."""
        self.register_buffer("expert_bias", torch.zeros(self.n_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, seq_len: int) -> Routing:
        """x [N, h], N a multiple of ``seq_len`` (whole sequences, token order) → :class:`Routing`."""
        with torch.autocast(x.device.type, enabled=False):        # fp32 under bf16/fp16 autocast too
            logits = F.linear(x.float(), self.weight.float())
            p = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        experts = torch.topk(p + self.expert_bias, self.top_k, dim=-1).indices
        weights = p.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        kept = capacity_mask(experts, self.n_experts, seq_len, self.capacity, self.sequence_axis)
        scores = p if self.score == "softmax" else p / p.sum(-1, keepdim=True)
        return Routing(experts, weights * kept, kept, scores)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """β ← β + rate·sign(mean(load) − load) (module docstring), ``load`` [n] a step's slot counts."""
        load = load.float()
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))


def capacity_mask(experts: torch.Tensor, n_experts: int, seq_len: int, capacity: Optional[float],
                  sequence_axis=None) -> torch.Tensor:
    """[N, k] bool: the slots kept under ``capacity`` (module docstring; all True when None). Each
    sequence's slots are counted per expert in (token, choice) order; a slot is kept while its
    running count is at most ⌈capacity·k·S/n⌉. ``sequence_axis``: the context ranks holding the
    rest of each sequence (``seq_len`` is this rank's two chunks; module docstring)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    n_tok, k = experts.shape
    b, parts = n_tok // seq_len, sequence_axis.size if sequence_axis is not None else 1
    limit = math.ceil(capacity * k * seq_len * parts / n_experts)
    onehot = F.one_hot(experts.view(b, seq_len * k), n_experts)                      # [b, s·k, n]
    running = onehot.cumsum(1)
    if parts > 1:                                        # this rank's chunks i, 2C − 1 − i start later
        chunks = onehot.view(b, 2, -1, n_experts)
        every = C.all_gather(chunks.sum(2).unsqueeze(0), sequence_axis, 0)           # [C, b, 2, n]
        in_order = torch.cat([every[:, :, 0], every.flip(0)[:, :, 1]]).transpose(0, 1)   # [b, 2C, n]
        before = in_order.cumsum(1) - in_order
        i = sequence_axis.rank
        start = torch.stack([before[:, i], before[:, 2 * parts - 1 - i]], 1)          # [b, 2, n]
        running = (chunks.cumsum(2) + start.unsqueeze(2)).view(b, seq_len * k, n_experts)
    running = running.gather(-1, experts.view(b, seq_len * k, 1))
    return (running <= limit).view(n_tok, k)


def sequence_aux_loss(routing: Routing, n_experts: int, seq_len: int, sequence_axis=None) -> torch.Tensor:
    """Σ_b L_b over this call's sequences (module docstring), fp32, differentiable in the scores.
    ``sequence_axis``: the context ranks holding the rest of each sequence (module docstring): the
    sums are completed over them and every one of them returns the same Σ_b L_b."""
    n_tok, k = routing.experts.shape
    b = n_tok // seq_len
    counts = F.one_hot(routing.experts.view(b, seq_len * k), n_experts).sum(1)       # [b, n]
    prob = routing.scores.view(b, seq_len, n_experts).sum(1)
    if sequence_axis is not None and sequence_axis.size > 1:
        counts, prob = C.all_reduce(counts, sequence_axis), reduce_from_group(prob, sequence_axis)
        seq_len *= sequence_axis.size
    f = counts.float() * (n_experts / (k * seq_len))
    return (f * (prob / seq_len)).sum()
