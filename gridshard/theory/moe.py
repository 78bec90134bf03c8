"""The communication of one MoE layer's dispatch and combine at E > 1 expert ranks, in closed form
(:mod:`gridshard.moe.dispatch` moves exactly this; the ledger's entries equal it, test-asserted).

Notation for expert rank ε of E: n experts, n_l = n/E per rank, c^σ_e the kept slots of rank σ's
tokens for expert e (the counts every rank all-gathers), a^σ_ρ = Σ_{e of ρ} c^σ_e the slots rank σ
sends to rank ρ, N_σ rank σ's tokens, N_max = max_σ N_σ, k choices per token, h the hidden size,
b the activation's bytes per element. One layer's forward and backward, per rank:

    counts (both)       all_gather      1 call       E·(n + 1)·8
    all_to_all          all_to_all_v    4 calls      2·h·b·(Σ_{ρ≠ε} a^ε_ρ + Σ_{σ≠ε} a^σ_ε)
    all_gather          all_gather      4 calls      E·N_max·(h·b + 8·k + 4·k) + E·N_max·h·b
                        reduce_scatter  3 calls      2·E·N_max·h·b + E·N_max·k·4

(all_to_all: dispatch and combine forward, their reverses backward, each sending what leaves the
rank; all_gather: x, the choices (int64) and the weights (fp32) gathered and y reduce-scattered
forward, x's and the weights' gradients reduce-scattered and y's gradient gathered backward.
Payloads as the ledger counts them: the whole gathered tensor for all_gather and reduce_scatter,
the bytes sent to other ranks for all_to_all_v.) A full recompute runs the forward's share again.

Under balanced routing (c^σ_e = N·k/n for every σ, e) the all-to-all's bytes are
2·h·b·N·k·(E − 1)/E per direction pair, :func:`balanced_all_to_all_bytes`.
"""
from __future__ import annotations

from typing import Sequence


def dispatch_volume(kind: str, counts: Sequence[Sequence[int]], tokens: Sequence[int], rank: int, hidden: int,
                    top_k: int, elem_bytes: int) -> dict:
    """op → (calls, payload bytes) of one layer's forward and backward on expert rank ``rank``, the
    counts' all-gather included (module docstring): ``counts`` [E][n] the kept slots c^σ_e,
    ``tokens`` [E] the N_σ, ``kind`` ``parallel.expert_dispatch``."""
    E, n = len(counts), len(counts[0])
    n_l, counted = n // E, E * (n + 1) * 8
    sent = lambda s, r: sum(counts[s][r * n_l:(r + 1) * n_l])        # noqa: E731 — a^s_r
    if kind == "all_to_all":
        moved = sum(sent(rank, r) for r in range(E) if r != rank) + sum(sent(s, rank) for s in range(E) if s != rank)
        return {"all_gather": (1, counted), "all_to_all_v": (4, 2 * hidden * elem_bytes * moved)}
    rows, hb = E * max(tokens), hidden * elem_bytes
    return {"all_gather": (5, counted + rows * (hb + 12 * top_k) + rows * hb),
            "reduce_scatter": (3, 2 * rows * hb + rows * top_k * 4)}


def balanced_all_to_all_bytes(tokens: int, top_k: int, hidden: int, elem_bytes: int, expert: int) -> float:
    """One layer's all-to-all bytes per rank, forward and backward, under balanced routing."""
    return 2 * 2 * hidden * elem_bytes * tokens * top_k * (expert - 1) / expert
