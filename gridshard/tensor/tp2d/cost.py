"""2D's tensor-parallel bytes of one micro-batch on a rank, composed from :mod:`gridshard.tensor.tp2d.theory`
(the functions the ledger tests assert). Imports no torch."""
from __future__ import annotations

import math

from ...theory import CommVolume
from . import theory as tp2d
from ...theory.memory import FP32


def recompute2d_comm(cfg, tokens: int, q: int) -> dict:
    """Adapter (no theory function exists for it): what ``recompute=full`` repeats per 2D layer —
    the forward SUMMA products of q|k|v, o and gate|up (the down projection's input is the last
    tensor backward needs, as in 1D) and the two norms' forward row all-reduce of N/q·4 bytes."""
    h, f, d = cfg.hidden, cfg.ffn_hidden, cfg.head_dim
    qkv = h + 2 * cfg.kv_heads * d
    norm = {"row": CommVolume(q).add("all_reduce", tokens // q * FP32, 2), "col": CommVolume(q)}
    return tp2d.combine(tp2d.summa_ab_comm(tokens, h, qkv, q), tp2d.summa_ab_comm(tokens, h, h, q),
                        tp2d.summa_ab_comm(tokens, h, 2 * f, q), norm)


def tensor_comm_2d(cfg, layout, seq: int, layers: int, first: bool, last: bool) -> list:
    """Per-axis volumes of one micro-batch on a 2D rank, flattened to a CommVolume list (both
    groups have q ranks and share the node's link)."""
    q = math.isqrt(layout.tensor)
    m, h, n = layout.micro_batch, cfg.hidden, layout.micro_batch * seq
    parts = [tp2d.block2d_comm(m, seq, h, cfg.ffn_hidden, q, heads=cfg.heads, kv_heads=cfg.kv_heads)] * layers
    if layout.recompute == "full":
        parts += [recompute2d_comm(cfg, n, q)] * layers
    if first:
        parts.append(tp2d.embedding2d_comm(m, seq, h, q))
    if last:
        head = tp2d.tied_head2d_comm(n, h, cfg.vocab_size, q) if cfg.tie_embeddings and first else \
            tp2d.linear2d_comm(n, h, tp2d.padded_vocab(cfg.vocab_size, q), q)
        parts += [tp2d.rmsnorm2d_comm(n, h, q), head, tp2d.cross_entropy2d_comm(n, q)]
    return [tp2d.total(p) for p in parts]
