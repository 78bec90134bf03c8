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
2·h·b·N·k·(E − 1)/E per direction pair (docs/moe.md compares the dispatchers with it).
"""
from __future__ import annotations

from typing import Sequence


def dispatch_volume(kind: str, counts: Sequence[Sequence[int]], tokens: Sequence[int], rank: int, hidden: int,
                    top_k: int, elem_bytes: int, forward_only: bool = False) -> dict:
    """op → (calls, payload bytes) of one layer's forward and backward on expert rank ``rank``, the
    counts' all-gather included (module docstring): ``counts`` [E][n] the kept slots c^σ_e,
    ``tokens`` [E] the N_σ, ``kind`` ``parallel.expert_dispatch``. ``forward_only``: the forward's
    share, what a full recompute runs again (all_to_all: the counts and 2 of the 4 exchanges;
    all_gather: the counts, x, choices and weights gathered, y reduce-scattered)."""
    E, n = len(counts), len(counts[0])
    n_l, counted = n // E, E * (n + 1) * 8
    sent = lambda s, r: sum(counts[s][r * n_l:(r + 1) * n_l])        # noqa: E731 — a^s_r
    if kind == "all_to_all":
        moved = sum(sent(rank, r) for r in range(E) if r != rank) + sum(sent(s, rank) for s in range(E) if s != rank)
        half = 1 if forward_only else 2
        return {"all_gather": (1, counted), "all_to_all_v": (2 * half, half * hidden * elem_bytes * moved)}
    rows, hb = E * max(tokens), hidden * elem_bytes
    if forward_only:
        return {"all_gather": (4, counted + rows * (hb + 12 * top_k)), "reduce_scatter": (1, rows * hb)}
    return {"all_gather": (5, counted + rows * (hb + 12 * top_k) + rows * hb),
            "reduce_scatter": (3, 2 * rows * hb + rows * top_k * 4)}


def balanced_dispatch_volume(kind: str, expert: int, experts: int, tokens: float, hidden: int, top_k: int,
                             elem_bytes: int, forward_only: bool = False) -> dict:
    """:func:`dispatch_volume` under balanced routing, every rank with ``tokens`` tokens and
    c^σ_e = N·k/n slots for every expert (what the planner prices; fractional slots kept)."""
    E = expert
    return dispatch_volume(kind, [[tokens * top_k / experts] * experts] * E, [tokens] * E, 0, hidden, top_k,
                           elem_bytes, forward_only)


def moe_layer_saved_tensors(cfg, dense: dict, residual: int, tokens: int, sequences: int, recompute: str,
                            e: int, param_bytes: int = 4, expert: int = 1) -> dict:
    """What one MoE decoder layer keeps for backward, tensor by tensor: the dense layer's ``dense``
    (:func:`gridshard.theory.memory.layer_saved_tensors`, same recompute) with its MLP's tensors
    replaced by the MoE block's, for N = ``tokens`` (the tensor group's micro-batch: the block runs
    on it whole, :meth:`gridshard.moe.layer.MoEBlock.tokens_over`), b = ``sequences``, n experts, k
    per token, f_e wide, s shared, M = N·k slots (dropless; capacity keeps fewer), e activation and
    p parameter bytes (asserted against the saved-tensor meter, ``tests/test_moe_memory.py``)::

        router     N·n·4 (scores) + N·k·8 (choices) + N·4 + N·k·4 (normalising) + N·k·1 (kept)
                   + N·h·4 if e < 4 (its fp32 input) + n·h·4 if p < 4 (its fp32 weight)
        aux loss   b·n·4
        dispatch   M·8 (token of each slot) + M·8 (slot of each result)
        experts    M·(h + 3·f_e)·e          (rows, gate|up, the product; silu(g) rebuilt from g in
                                            backward, :func:`gridshard.nn.swiglu.swiglu`)
        combine    N·k·e (weights) + N·k·h·e (the slots' results)
        shared     N·3·s·f_e·e              (gate|up, the product, as the experts)

    and the block's input: kept (N·h·e) where the router reads it in fp32 or the shared experts read
    it, when it is a tensor of its own (gathered from the residual block, T > 1) or under recompute
    ``none`` (``selective`` rebuilds the norm output; the dense count's y, R·e, is taken out under
    ``none`` and this counted instead). At E > 1 (all-to-all) the experts' rows are the received
    ones (balanced: M) and the reordering keeps 2·M·8 more. ``full``: the layer input only."""
    if recompute == "full":
        return dict(dense)
    n, k, h, fe = cfg.experts, cfg.experts_per_token, cfg.hidden, cfg.expert_ffn_hidden
    N, M, b = tokens, tokens * k, sequences
    out = {name: v for name, v in dense.items() if name not in ("gate g", "silu(g)", "up u", "silu(g)·u")}
    gathered = residual != N * h
    if recompute == "none":                              # the norm's y is not what the block keeps
        norm = next(name for name in out if name.startswith("mlp_norm"))
        out[norm] -= residual * e
    reads_x = e >= 4 or cfg.shared_experts > 0
    if reads_x and (gathered or recompute == "none"):
        out["moe input"] = N * h * e
    out["router"] = N * n * 4 + N * k * 8 + N * 4 + N * k * 4 + N * k + (N * h * 4 if e < 4 else 0) \
        + (n * h * 4 if param_bytes < 4 else 0)
    out["aux loss"] = b * n * 4
    out["dispatch"] = 2 * M * 8 + (2 * M * 8 if expert > 1 else 0)
    out["experts"] = M * (h + 3 * fe) * e
    out["combine"] = N * k * e + N * k * h * e
    if cfg.shared_experts:
        out["shared experts"] = N * 3 * cfg.shared_experts * fe * e
    return out
