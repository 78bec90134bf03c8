"""Context-parallel communication of one micro-batch on a rank at C > 1 (:mod:`gridshard.theory.context`).

Per layer and micro-batch, on the context group's link (:mod:`.price_links`): the ring sends
2·(C − 1) k/v blocks (forward and backward) and C fp32 gradient blocks, which hide under the
attention-core compute of the block in hand (**assumption**, :func:`_context_mb`); all-to-all
mode its all-to-alls (forward and backward), exposed whole.
"""
from __future__ import annotations

from ..theory import CommVolume
from ..theory import context as ctx_theory
from .layouts import Layout
from .price_compute import gemm_flops
from .price_links import FP32, _Pricing, comm_cpu_seconds, comm_seconds


def context_comm(cfg, layout: Layout, seq: int, layers: int, precision: str) -> tuple:
    """(ring sends CommVolume, all-to-all CommVolume) of one micro-batch's ``layers`` attention
    layers at C > 1 (:mod:`gridshard.theory.context`: the rank's heads after the tensor split, its
    2c = S/C tokens; 2D: its m/q sequences); (None, None) at C = 1."""
    C, T, mode = layout.context, layout.tensor, layout.mode
    if C == 1:
        return None, None
    e = 2 if precision in ("bf16", "fp16") else FP32
    m = layout.micro_batch // mode.batch_split(T)          # 2D: m/q rows, 3D: m/q²
    H, K = cfg.heads // mode.head_split(T), mode.local_kv_heads(cfg.kv_heads, T)
    if layout.context_mode == "all_to_all":
        vol = ctx_theory.all_to_all_attention_volume(C, m, seq // C, H, K, cfg.head_dim, e)
        return None, CommVolume(C).add("all_to_all", vol["forward"][1], 2 * vol["forward"][0] * layers)
    kv = ctx_theory.ring_block_bytes(m, seq // C, K, cfg.head_dim, e)       # forward and backward: C − 1 each
    dkv = ctx_theory.ring_block_bytes(m, seq // C, K, cfg.head_dim, FP32)   # backward: C fp32 gradient sends
    return CommVolume(2).add("send", kv, 2 * (C - 1) * layers).add("send", dkv, C * layers), None


def _context_mb(cfg, layout: Layout, pr: _Pricing, seq: int, layers: int, precision: str) -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's context communication.
    **Assumption** (stated in docs/planner.md): the ring's sends overlap the attention-core
    compute of the block in hand (12·S·h FLOPs per token and layer, forward and backward, on the
    rank's S/C tokens), so only what exceeds it is exposed; all-to-all sits between dependent
    operations and is exposed whole."""
    ring, a2a = context_comm(cfg, layout, seq, layers, precision)
    level, hw = pr.levels["context"], pr.hw
    if ring is None and a2a is None:
        return 0.0, 0.0
    t = comm_seconds([ring, a2a], hw, level, pr.skew)
    if ring is not None:
        core = layout.micro_batch * seq * layers * 12.0 * seq * cfg.hidden / (layout.context * layout.tensor)
        t = max(0.0, t - core / hw.flops_rate(precision, gemm_flops(cfg, layout, seq)) * pr.stretch)
    return t, comm_cpu_seconds([ring, a2a], hw, level)


__all__ = ["context_comm"]
