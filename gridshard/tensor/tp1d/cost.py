"""1D's tensor-parallel bytes of one micro-batch on a rank, composed from :mod:`gridshard.tensor.tp1d.theory`
(the functions the ledger tests assert). Imports no torch."""
from __future__ import annotations

from . import theory as tp1d


def tensor_comm_1d(cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> list:
    """CommVolumes of one micro-batch on a 1D rank holding ``layers`` decoder layers, the activations
    in ``e``-byte elements: the compute dtype, which the row layers' all-reduces, the column layers'
    input-gradient all-reduces and SP's gathers / reduce-scatters carry (2 bytes under bf16/fp16
    autocast, as Megatron's); the weight-gradient all-reduces (norm weights under SP, replicated k/v
    weights) and the cross-entropy statistics stay fp32."""
    T, sp, m, h = layout.tensor, layout.sequence_parallel, layout.micro_batch, cfg.hidden
    vols = [tp1d.block_comm(m, seq, h, T, sp, e, heads=cfg.heads, kv_heads=cfg.kv_heads, grad_bytes=4)] * layers
    if layout.recompute == "full":
        vols += [tp1d.block_recompute_comm(m, seq, h, T, sp, e)] * layers
    if first:
        vols.append(tp1d.embedding_comm(m, seq, h, T, sp, e))
    if last:
        vols += [tp1d.norm_comm(h, T, sp), tp1d.head_comm(m, seq, h, T, sp, e), tp1d.cross_entropy_comm(m * seq, T)]
    return vols
