"""1D's tensor-parallel bytes of one micro-batch on a rank, composed from :mod:`gridshard.tensor.tp1d.theory`
(the functions the ledger tests assert). Imports no torch."""
from __future__ import annotations

from . import theory as tp1d


def tensor_comm_1d(cfg, layout, seq: int, layers: int, first: bool, last: bool) -> list:
    """CommVolumes of one micro-batch on a 1D rank holding ``layers`` decoder layers."""
    T, sp, m, h = layout.tensor, layout.sequence_parallel, layout.micro_batch, cfg.hidden
    vols = [tp1d.block_comm(m, seq, h, T, sp, heads=cfg.heads, kv_heads=cfg.kv_heads)] * layers
    if layout.recompute == "full":
        vols += [tp1d.block_recompute_comm(m, seq, h, T, sp)] * layers
    if first:
        vols.append(tp1d.embedding_comm(m, seq, h, T, sp))
    if last:
        vols += [tp1d.norm_comm(h, T, sp), tp1d.head_comm(m, seq, h, T, sp), tp1d.cross_entropy_comm(m * seq, T)]
    return vols
