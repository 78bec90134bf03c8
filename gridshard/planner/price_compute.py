"""Compute of one micro-batch on a rank: its FLOPs and the seconds they take.

Per micro-batch on the slowest pipeline rank (notation: :mod:`.cost_time`; × the node's contention,
``Hardware.contention``, where the node is not over-subscribed — :mod:`.cost_time`, "Two bounds")::

    F_layer = flops_per_token(V=0, L=1)             (6·N_mm of one layer + 12·s·h)
    F_head  = flops_per_token(V, L=0)               (6·V·h, last stage only)
    F       = m·s·(L_r·F_layer + F_head)/T  (an MoE layer: its MLP's 18·h·f/T replaced by F_moe,
                                          not divided by T: :mod:`.price_expert`)
            + recompute: full  m·s·L_r·F_layer/(3T)                 (one more forward)
                         selective m·s·L_r·(F_layer(s) − F_layer(s=0))/(3T)   (attention core forward)
    t_gemm  = F / (peak[precision] · efficiency(G))   G = FLOPs of the rank's gate|up GEMM:
              2·N·h·f (none), 2·N·h·f/T (1D), 2·N·h·f/q³ (2D: one SUMMA panel step),
              2·N·h·f/T (3D, T = q³: the rank's one product X_il·A_lj)
    t_elem  = 3 · activation bytes of the micro-batch / elementwise_bandwidth   (written forward,
              read backward, gradient written: a stated approximation; the hardware's
              memory_bandwidth when it has no element-wise figure) — the bytes the layers write
              without recompute (recompute changes what is kept, not what is computed), and a
              fourth pass with full recompute (the forward again)
    t_ops   = L_r · layer_overhead_s · (4/3 with full recompute)
"""
from __future__ import annotations

from ..theory.training import flops_per_token
from .hardware import Hardware
from .layouts import Layout
from .price_expert import moe_flops_per_token

ELEMENTWISE_PASSES = 3


def gemm_flops(cfg, layout: Layout, seq: int) -> float:
    """FLOPs of one of the rank's gate|up GEMMs (the module docstring's G)."""
    N, h, f = layout.micro_batch * seq // layout.context, cfg.hidden, cfg.ffn_hidden
    return 2.0 * N * h * f / layout.mode.gemm_split(layout.tensor)


def microbatch_flops(cfg, layout: Layout, seq: int, layers: int, last: bool, moe_layers: int = 0) -> float:
    """F of the module docstring: one micro-batch's FLOPs on a rank with ``layers`` decoder
    layers (+ the head when ``last``), with the recompute's extra forward; at C > 1 the rank's S/C
    tokens of each sequence, each attending over the whole sequence (÷ C); ``moe_layers`` of the
    layers are MoE layers (:mod:`.price_expert`: their block's FLOPs repeat on the T ranks)."""
    m, T, kvh = layout.micro_batch, layout.tensor, cfg.kv_heads * cfg.head_dim
    ffn = cfg.ffn_hidden * cfg.mlp_matrices / 3      # flops_per_token counts SwiGLU's 3·h·f; a ViT's GELU MLP has 2
    f_layer = flops_per_token(0, cfg.hidden, 1, ffn, seq, kvh)
    f_head = flops_per_token(cfg.vocab_size, cfg.hidden, 0, ffn, seq, kvh)
    # an MoE layer: its MLP's 18·h·f replaced by F_moe, not divided by T (.price_expert)
    moe = moe_layers * (moe_flops_per_token(cfg) - 18.0 * cfg.hidden * cfg.ffn_hidden / T) if moe_layers else 0.0
    layer_flops = m * seq * (layers * f_layer / T + moe)
    flops = layer_flops + m * seq * (f_head if last else 0.0) / T
    if layout.recompute == "full":
        flops += layer_flops / 3
    elif layout.recompute == "selective":
        core = f_layer - flops_per_token(0, cfg.hidden, 1, ffn, 0, kvh)
        flops += m * seq * layers * core / (3 * T)
    return flops / layout.context


def _compute_mb(cfg, layout: Layout, hw: Hardware, seq: int, layers: int, last: bool, precision: str,
                activation_bytes: int, moe_layers: int = 0) -> tuple:
    """(seconds at full speed, FLOPs) of one micro-batch's compute: t_gemm + t_elem + t_ops."""
    flops = microbatch_flops(cfg, layout, seq, layers, last, moe_layers)
    t_gemm = flops / hw.flops_rate(precision, gemm_flops(cfg, layout, seq))
    passes = ELEMENTWISE_PASSES + (1 if layout.recompute == "full" else 0)      # full: the forward again
    t_elem = passes * activation_bytes / (hw.elementwise_bandwidth or hw.memory_bandwidth)
    t_ops = layers * hw.layer_overhead_s * (4.0 / 3.0 if layout.recompute == "full" else 1.0)
    return t_gemm + t_elem + t_ops, flops


__all__ = ["microbatch_flops", "gemm_flops"]
