"""3D's tensor-parallel bytes of one micro-batch on a rank per cube axis, composed from
:mod:`gridshard.tensor.tp3d.theory` (the functions the ledger tests assert), and the link of each axis.
Imports no torch."""
from __future__ import annotations

import functools

from . import theory as tp3d


def tensor_comm_3d(cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> dict:
    """Per-axis volumes (axis → CommVolume, :data:`gridshard.tensor.tp3d.theory.AXES`) of one micro-batch on a
    3D rank holding ``layers`` decoder layers: :func:`~gridshard.tensor.tp3d.theory.block3d_comm` per layer
    (+ :func:`~gridshard.tensor.tp3d.theory.block3d_recompute_comm` with full recompute) and
    :func:`~gridshard.tensor.tp3d.theory.ends3d_comm` on the end stages. The axes keep their own group sizes
    (q or q²) and are priced on their own links (:func:`link_levels`, ``tensor_axes``). ``e``: the bytes of
    the compute dtype, which the products' blocks (cast before their gathers,
    :func:`gridshard.tensor.tp3d.matmul.compute_dtype`), the vectors and the embedding carry under
    ``train.precision`` bf16; the norms' statistics and the cross-entropy stay fp32, the tokens int64."""
    q = layout.mode.side(layout.tensor)
    m, h, f = layout.micro_batch, cfg.hidden, cfg.ffn_hidden
    block = tp3d.block3d_comm(m, seq, h, f, q, e, heads=cfg.heads, kv_heads=cfg.kv_heads)
    parts = [block] * layers
    if layout.recompute == "full":
        parts += [tp3d.block3d_recompute_comm(m, seq, h, f, q, e, heads=cfg.heads, kv_heads=cfg.kv_heads)] * layers
    parts.append(tp3d.ends3d_comm(m, seq, h, cfg.vocab_size, q, e, first=first, last=last,
                                  tied=bool(cfg.tie_embeddings)))
    return tp3d.combine(*parts)


@functools.lru_cache(maxsize=256)
def cube_axis_levels(q: int, world: int, per_node: int) -> dict:
    """Link of each 3D axis (:data:`gridshard.tensor.tp3d.theory.AXES`): ``inter`` when any of its groups, in
    any of the world's tensor blocks (T = q³ consecutive ranks, the tensor dims innermost in the
    order (weight, input, output): :func:`gridshard.tensor.tp3d.theory.axis_groups`), has ranks on two
    nodes of ``per_node`` consecutive ranks, else ``intra``. So ``output`` (q consecutive ranks) is
    the last to leave a node, then ``input`` (q²), then ``weight`` and the two q²-rank flattened axes
    (the whole cube)."""
    T = q ** 3
    out = {}
    for axis, groups in tp3d.axis_groups(q).items():
        split = any(len({(b * T + t) // per_node for t in g}) > 1 for b in range(max(1, world // T)) for g in groups)
        out[axis] = "inter" if split else "intra"
    return out
