"""Dispatch and combine of an MoE layer's token-slots: on one rank, or between the E expert ranks.

One rank (E = 1; :func:`sort_slots`, :func:`combine`). For the N·k slots of N tokens (slot
t·k + j: token t's j-th choice), the kept ones sorted by expert, stable (token order within an
expert): ``order`` [M], ``load`` [n] = c_e. The rows x[order // k] go through the experts in
blocks c_0 … c_{n−1}; each result is put back at its slot and token t's output is
y_t = Σ_j g_{t,j} · y_{t·k+j}, summed over j in order (no scatter-add: the same bits every run).

Between ranks (E > 1, :class:`ExpertDispatch`): expert rank ε holds the n_l = n/E experts
ε·n_l … (ε+1)·n_l − 1 (:mod:`gridshard.mesh_expert`). First the ranks tell each other their
counts: one all-gather over ``mesh.expert`` of [c_0 … c_{n−1}, N] (int64, (n + 1)·8 bytes per
rank). Then, with ``parallel.expert_dispatch``:

* ``all_to_all`` (default). The sorted rows are already grouped by destination: rank ρ's block
  is experts ρ·n_l … (ρ+1)·n_l − 1, a_ρ = Σ of their counts rows. One all-to-all with uneven
  splits sends them (dispatch); rank ε receives from each source σ the rows c^σ_e of its experts
  e, σ-major, reorders them expert-major (σ order within an expert), computes, restores the
  σ-major order and sends each source its rows back (combine, the reverse all-to-all), where
  they are combined as on one rank. Bytes a rank sends per layer, forward:

      dispatch  h·b · Σ_{ρ≠ε} a_ρ          combine  h·b · Σ_{σ≠ε} Σ_{e mine} c^σ_e

  (b bytes per element; the backward sends the same two amounts the other way.) Under
  balanced routing each is h·b·N·k·(E − 1)/E: all-to-all moves only what leaves the rank.

* ``all_gather`` (small E, or load so uneven that all-to-all's splits are ragged). Every rank
  gathers all N_max·E token rows (N_max the largest N, shorter ranks padded), their choices
  and weights; computes its experts' slots, weighted; sums over each token's k slots; and a
  reduce-scatter over the expert ranks returns every rank its tokens' sum. Forward payloads
  (all-gather and reduce-scatter as the ledger counts them, the whole gathered tensor):

      x  E·N_max·h·b,   choices E·N_max·k·8,   weights E·N_max·k·4,   y  E·N_max·h·b

  and the backward reduce-scatters x's and the weights' gradients and all-gathers y's. It
  moves (E − 1)/E of everything whatever the routing, but needs no count-dependent splits and
  no reordering, so for E = 2 on a fast link it can beat all-to-all; :mod:`gridshard.theory.moe`
  prices both.

Each exchange is an autograd function whose backward is the reverse exchange, so gradients reach
the router (through the weights) and the tokens on the rank that owns them. Every expert rank
runs every exchange, whatever it receives: a rank whose experts get no row computes empty blocks
and still gives every expert weight a (zero) gradient, so no reduction waits on it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.dual_ops import gather_sequence, reduce_scatter_sequence

DISPATCHES = ("all_to_all", "all_gather")


def sort_slots(routing, n_experts: int) -> tuple:
    """(``order`` [M]: the kept slots by expert, stable; ``load`` [n]: kept slots per expert)."""
    slot_expert = routing.experts.flatten()
    kept = routing.kept.flatten().nonzero().squeeze(1)
    order = kept[torch.argsort(slot_expert[kept], stable=True)]
    return order, torch.bincount(slot_expert[order], minlength=n_experts)


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs [M, h] of the slots ``order`` → y [N, h], y_t = Σ_j g_{t,j} · y_{t·k+j}."""
    n_tokens, k = weights.shape
    y_slots = y_sorted.new_zeros(n_tokens * k, y_sorted.shape[-1]).index_put((order,), y_sorted)
    return (y_slots.view(n_tokens, k, -1) * weights.unsqueeze(-1).to(y_slots.dtype)).sum(1)


class _Exchange(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward: the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows, axis, send, recv):
        ctx.axis, ctx.send, ctx.recv = axis, send, recv
        return C.all_to_all_uneven(rows, axis, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return C.all_to_all_uneven(grad, ctx.axis, ctx.recv, ctx.send), None, None, None


class ExpertDispatch:
    """The exchange of an MoE layer's slots over the expert ranks ``axis`` (module docstring) for
    ``n_experts`` n in all, by ``kind`` (``parallel.expert_dispatch``)."""

    def __init__(self, axis, n_experts: int, kind: str = "all_to_all"):
        if kind not in DISPATCHES:
            raise ValueError(f"expert_dispatch={kind!r} is not one of {DISPATCHES}")
        self.axis, self.n, self.kind = axis, n_experts, kind
        self.local = n_experts // axis.size                    # n_l: experts per rank
        self.first = axis.rank * self.local                    # my first expert

    def _counts(self, load: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """[E, n + 1] (int64, on the CPU): every expert rank's slots per expert and its N."""
        mine = torch.cat([load, load.new_tensor([n_tokens])]).unsqueeze(0)
        return C.all_gather(mine, self.axis, 0).cpu()

    def __call__(self, flat: torch.Tensor, routing, experts) -> tuple:
        """y [N, h] of this rank's tokens ``flat`` [N, h] under ``routing``, and ``load`` [n]."""
        order, load = sort_slots(routing, self.n)
        counts = self._counts(load, flat.shape[0])
        if self.kind == "all_gather":
            return self._all_gather(flat, routing, experts, int(counts[:, -1].max())), load
        return combine(self._all_to_all(flat[order // routing.weights.shape[1]], counts, experts), order,
                       routing.weights), load

    def _all_to_all(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        E, mine = self.axis.size, slice(self.first, self.first + self.local)
        send = counts[self.axis.rank, :-1].view(E, self.local).sum(1).tolist()     # rows for each rank's experts
        incoming = counts[:, mine]                                                   # [E_src, n_l]
        received = _Exchange.apply(rows, self.axis, send, incoming.sum(1).tolist())
        expert_of_row = torch.arange(self.local).repeat(E).repeat_interleave(incoming.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True).to(rows.device)       # source order within an expert
        y = experts(received[by_expert], incoming.sum(0).tolist())
        back = torch.empty_like(by_expert).index_put_((by_expert,), torch.arange(len(by_expert), device=rows.device))
        return _Exchange.apply(y[back], self.axis, incoming.sum(1).tolist(), send)

    def _all_gather(self, flat: torch.Tensor, routing, experts, n_max: int) -> torch.Tensor:
        n_tokens, k = routing.weights.shape
        pad = n_max - n_tokens
        chosen = torch.where(routing.kept, routing.experts, -1)                      # dropped slots: no expert
        x_all = gather_sequence(F.pad(flat, (0, 0, 0, pad)), self.axis, 0)          # [E·N_max, h]
        w_all = gather_sequence(F.pad(routing.weights, (0, 0, 0, pad)), self.axis, 0)
        chosen_all = C.all_gather(F.pad(chosen, (0, 0, 0, pad), value=-1), self.axis, 0).flatten()
        local = chosen_all - self.first
        slots = ((local >= 0) & (local < self.local)).nonzero().squeeze(1)
        slots = slots[torch.argsort(local[slots], stable=True)]
        y = experts(x_all[slots // k], torch.bincount(local[slots], minlength=self.local).tolist())
        y = y * w_all.flatten()[slots].unsqueeze(-1).to(y.dtype)
        y_all = y.new_zeros(x_all.shape[0] * k, y.shape[-1]).index_put((slots,), y).view(-1, k, y.shape[-1]).sum(1)
        return reduce_scatter_sequence(y_all, self.axis, 0)[:n_tokens]
