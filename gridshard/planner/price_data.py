"""Data-parallel communication of one step on a rank (over data × context: D·C ranks; an MoE model's
experts split over E > 1 expert ranks over their D·C/E expert-data ranks, in units of their own).

Per step, on the data group's link (:mod:`.price_links`; bytes:
:func:`~gridshard.theory.training.dp_gradient_allreduce` over the trainer's buckets at ZeRO-0,
:func:`~gridshard.theory.zero.zero_step_comm` at ZeRO 1–3):

* the gradient reduction (ZeRO-0 all-reduce, ZeRO 1–3 reduce-scatters) is issued during the
  backward (:func:`~gridshard.theory.zero.reduces_in_backward`: the last micro-batch's at P = 1,
  every micro-batch's under ZeRO-2/3's sharded accumulation, with pipeline stages too except
  ``zero_bubble``): **assumption** — it hides under ``dp_overlap`` × one micro-batch's backward
  (2/3 of its compute; with sharded accumulation each of the A waves under its own micro-batch's,
  the last unit of the last wave exposed); otherwise (ZeRO-0/1 with P > 1, ``zero_bubble``) it runs after the
  schedule, exposed; its last bucket/unit is always exposed;
* ZeRO-1/2's all-gather of updated rows runs after the optimizer: exposed;
* ZeRO-3's per-layer all-gathers in forward and backward: exposed (no prefetch), counted in
  t_mb so the bubble stretches them too — ``2·A·L_r`` calls of one layer's bytes
  (:func:`~gridshard.theory.zero.zero_step_comm`), each latency + bytes/bandwidth + skew; with
  full recompute the recomputation runs after the backward regather (no third gather).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..theory.training import bucket_partition, dp_gradient_allreduce
from ..theory.zero import reduces_in_backward, sharded_accumulation, unit_padded_numel, zero_step_comm
from .layouts import Layout
from .memo import rank_blocks
from .price_links import FP32, _Pricing, comm_cpu_seconds, comm_seconds


def data_comm(cfg, layout: Layout, layer_ids, first: bool, last: bool, A: int, bucket_bytes: int,
              experts: bool = False):
    """(gradient-reduction CommVolume, after-step / in-step gather CommVolume, reduction units) of one step
    over data × context (D·C ranks), for the rank's dense parameters; ``experts``: for its split
    experts instead (E > 1: their own units over the D·C/E expert-data ranks, :mod:`gridshard.mesh_expert`)."""
    D, E = layout.data * layout.context, layout.expert
    blocks = [b for b in rank_blocks(cfg, layout.tensor_mode, layout.tensor, layer_ids, first, last, E)
              if b.expert == experts]
    D = D // E if experts else D
    if D == 1 or not blocks:
        return None, None, 0
    if layout.zero == 0:
        numels = [b.numel for b in blocks]
        buckets = bucket_partition(numels, FP32, bucket_bytes)
        return dp_gradient_allreduce([sum(numels[i] for i in b) for b in buckets], D), None, len(buckets)
    units: dict = {}
    for b in blocks:
        units.setdefault(b.layer if b.in_decoder_layer else "root", []).append(b)
    size = {u: unit_padded_numel([b.numel for b in bs], D) for u, bs in units.items()}
    layer_units = [size[u] for u in units if u != "root"]
    sharded = sharded_accumulation(layout.zero, D, layout.pipeline, layout.pipeline_schedule,
                                   layout.overlap_grad_reduce)
    tied_root = layout.pipeline > 1 and bool(cfg.tie_embeddings) and (first or last)   # reduced after the tied sum
    vol = zero_step_comm(layer_units, size.get("root", 0), D, layout.zero, A, sharded_accumulation=sharded,
                         tied_root=tied_root)
    reduce, gather = (type(vol)(D).add(op, vol.payload_bytes(op) // max(1, vol.count(op)), vol.count(op))
                      for op in ("reduce_scatter", "all_gather"))
    return reduce, gather, len(size)


@dataclass
class _DataCost:
    """One step's data-parallel terms (seconds): the reduction, its exposed part, ZeRO-3's
    gathers per micro-batch, ZeRO-1/2's gather after the step, and the busy CPU of them all."""

    reduce_s: float = 0.0
    exposed_reduce_s: float = 0.0
    gather_per_mb_s: float = 0.0
    gather_after_s: float = 0.0
    busy_s: float = 0.0


def _data_step(cfg, layout: Layout, pr: _Pricing, layer_ids, first: bool, last: bool, A: int, bucket_bytes: int,
               compute_mb: float) -> _DataCost:
    """The data-parallel terms of one step (module docstring): the reduction hides under
    ``dp_overlap`` × 2/3 of one micro-batch's compute when the reducer reduces in the backward
    (:func:`~gridshard.theory.zero.reduces_in_backward`) — of each of the A micro-batches with
    sharded accumulation, whose A reduce-scatter waves each run in their micro-batch's backward —
    the last unit of the last wave exposed."""
    reduce, gather, units = data_comm(cfg, layout, layer_ids, first, last, A, bucket_bytes)
    ex_reduce, ex_gather, ex_units = data_comm(cfg, layout, layer_ids, first, last, A, bucket_bytes, experts=True)
    reduce, gather, units = [reduce, ex_reduce], [gather, ex_gather], units + ex_units
    level, hw, k = pr.levels["data"], pr.hw, pr.members_of("data")
    out = _DataCost(busy_s=comm_cpu_seconds(gather + reduce, hw, level, k))     # (None: no such calls)
    if any(g is not None for g in gather):
        t_gather = comm_seconds(gather, hw, level, pr.skew, k)
        if layout.zero == 3:
            out.gather_per_mb_s = t_gather / A          # per micro-batch (its layer gathers)
        else:
            out.gather_after_s = t_gather
    out.reduce_s = comm_seconds(reduce, hw, level, pr.skew, k)
    D = layout.data * layout.context
    ov = layout.overlap_grad_reduce                 # train.overlap_grad_reduce (the planner enumerates it)
    in_backward = reduces_in_backward(layout.zero, D, layout.pipeline, layout.pipeline_schedule, ov)
    # sharded accumulation: each micro-batch's reduce-scatters hide under that micro-batch's backward
    waves = A if sharded_accumulation(layout.zero, D, layout.pipeline, layout.pipeline_schedule, ov) else 1
    hide = hw.dp_overlap * (2.0 / 3.0) * compute_mb * waves if in_backward else 0.0
    if out.reduce_s:
        out.exposed_reduce_s = max(out.reduce_s - hide, out.reduce_s / max(1, units) / waves)
    return out


__all__ = ["data_comm"]
