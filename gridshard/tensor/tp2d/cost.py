"""2D's tensor-parallel bytes of one micro-batch on a rank, composed from :mod:`gridshard.tensor.tp2d.theory`
(the functions the ledger tests assert). Imports no torch."""
from __future__ import annotations

import math

from ...theory import CommVolume
from . import theory as tp2d
from ...theory.memory import FP32


def recompute2d_comm(cfg, tokens: int, q: int, e: int = 4) -> dict:
    """Adapter (no theory function exists for it): what ``recompute=full`` repeats per 2D layer —
    the forward SUMMA products of q|k|v, o and gate|up (the down projection's input is the last
    tensor backward needs, as in 1D) in ``e``-byte elements and the two norms' forward row all-reduce
    of N/q·4 bytes (fp32 statistics)."""
    h, f, d = cfg.hidden, cfg.ffn_hidden, cfg.head_dim
    qkv = h + 2 * cfg.kv_heads * d
    norm = {"row": CommVolume(q).add("all_reduce", tokens // q * FP32, 2), "col": CommVolume(q)}
    return tp2d.combine(tp2d.summa_ab_comm(tokens, h, qkv, q, e), tp2d.summa_ab_comm(tokens, h, h, q, e),
                        tp2d.summa_ab_comm(tokens, h, 2 * f, q, e), norm)


def tensor_comm_2d(cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> list:
    """Per-axis volumes of one micro-batch on a 2D rank, flattened to a CommVolume list (both
    groups have q ranks and share the node's link). ``e``: the bytes of the compute dtype, which
    every SUMMA panel and term, the norms' and the embedding's blocks carry under ``train.precision``
    bf16 (parameters stored in it, :func:`gridshard.tensor.tp2d.summa._autocast_operands`); the norms'
    statistics and the cross-entropy stay fp32, the tokens int64 (``tests/test_tensor_comm_dtype.py``
    holds the ledger of a bf16 run to this)."""
    q = math.isqrt(layout.tensor)
    m, h, n = layout.micro_batch, cfg.hidden, layout.micro_batch * seq
    parts = [tp2d.block2d_comm(m, seq, h, cfg.ffn_hidden, q, e, heads=cfg.heads, kv_heads=cfg.kv_heads)] * layers
    if layout.recompute == "full":
        parts += [recompute2d_comm(cfg, n, q, e)] * layers
    if first:
        parts.append(tp2d.embedding2d_comm(m, seq, h, q, e))
    if last:
        head = tp2d.tied_head2d_comm(n, h, cfg.vocab_size, q, e) if cfg.tie_embeddings and first else \
            tp2d.linear2d_comm(n, h, tp2d.padded_vocab(cfg.vocab_size, q), q, e)
        parts += [tp2d.rmsnorm2d_comm(n, h, q, e), head, tp2d.cross_entropy2d_comm(n, q)]
    return [tp2d.total(p) for p in parts]
