"""A Mixture-of-Experts model's own terms: its active FLOPs, the dispatch at E > 1 expert ranks, and
which link the expert group uses (issue 38; the layer: :mod:`gridshard.moe`).

Compute, per token of an MoE layer (n experts of width f_e, k per token, s shared, h hidden) in
place of the dense MLP's 6·3h·f::

    F_moe = 6·(n·h + (k + s)·3h·f_e)                 (router, the k chosen experts, the shared ones)

Under tensor parallelism the MoE block runs on the tensor group's whole micro-batch, the same on
every tensor rank (:meth:`gridshard.moe.layer.MoEBlock.tokens_over`): its FLOPs are *not* divided
by T, the rest of the layer's are. Expert parallelism does not change a rank's FLOPs under balanced
routing: each of the E ranks runs its n/E experts on the E ranks' slots sent to them, N·k slots on
average.

Dispatch, per micro-batch on the slowest pipeline rank (L_moe its MoE layers, N = m·s/C the tokens
the block runs on): :func:`gridshard.theory.moe.balanced_dispatch_volume` of each MoE layer
(forward and backward; a full recompute runs the forward's share again), b the activation's
bytes, priced on the expert group's link (:func:`~.price_links.expert_level`). It is exposed: the experts wait
for their rows and the next layer for the combined output.

Stated approximation: an MoE layer's tensor-parallel traffic is priced as a dense layer's
(:mod:`.price_tensor`); the block's own gathers in and out (``token_gathers``) replace the dense
MLP's entry and exit collectives, of the same activation size.
"""
from __future__ import annotations

from ..theory import CommVolume
from ..theory.moe import balanced_dispatch_volume
from .layouts import Layout
from .price_links import _Pricing, comm_cpu_seconds, comm_seconds


def moe_layer_count(cfg, layer_ids) -> int:
    """The MoE layers among ``layer_ids`` (None: all layers); 0 for a dense model."""
    if not getattr(cfg, "experts", 0):
        return 0
    ids = range(cfg.layers) if layer_ids is None else layer_ids
    return sum(1 for i in ids if cfg.is_moe_layer(i))


def moe_flops_per_token(cfg) -> float:
    """F_moe of the module docstring: an MoE layer's training FLOPs per token (router, k experts, shared)."""
    return 6.0 * (cfg.experts * cfg.hidden + (cfg.experts_per_token + cfg.shared_experts) * 3 * cfg.hidden
                  * cfg.expert_ffn_hidden)


def dispatch_volumes(cfg, layout: Layout, seq: int, moe_layers: int, precision: str) -> list:
    """CommVolumes of one micro-batch's dispatch and combine on a rank (module docstring)."""
    E = layout.expert
    if E <= 1 or not moe_layers:
        return []
    N = layout.micro_batch * seq / layout.context
    b = 4 if precision == "fp32" else 2
    out = []
    for forward_only, times in ((False, moe_layers), (True, moe_layers if layout.recompute == "full" else 0)):
        vol = balanced_dispatch_volume(layout.expert_dispatch, E, cfg.experts, N, cfg.hidden, cfg.experts_per_token,
                                       b, forward_only)
        if times:
            cv = CommVolume(E)
            for op, (calls, payload) in vol.items():
                cv.add(op, payload / calls, calls * times)
            out.append(cv)
    return out


def _expert_mb(cfg, layout: Layout, pr: _Pricing, seq: int, layer_ids, precision: str) -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's dispatch and combine."""
    vols = dispatch_volumes(cfg, layout, seq, moe_layer_count(cfg, layer_ids), precision)
    if not vols:
        return 0.0, 0.0
    level = pr.levels["expert"]
    return comm_seconds(vols, pr.hw, level, pr.skew), comm_cpu_seconds(vols, pr.hw, level)


__all__ = ["moe_layer_count", "moe_flops_per_token", "dispatch_volumes"]
