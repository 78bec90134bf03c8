"""Pipeline stage sends of one micro-batch on a rank (the bubble: :mod:`.cost_time`).

Each micro-batch crosses the rank's stage boundaries forward and backward,
:func:`~gridshard.theory.pipeline.boundary_bytes` each (``send`` link), exposed — the rank's
block of the hidden state (:meth:`gridshard.job_layout.TensorMode.boundary_block`: 1/T of it
under sequence parallelism, 1/q² in 2D, [m/q², s, h/q] = 1/T in 3D) in the run's compute dtype (``train.precision``: 2
bytes per element in bf16, as Megatron sends; theory.pipeline on what gridshard's autocast
runtime sends) — plus
``Hardware.p2p_call_overhead_s`` of schedule work per crossing (calibrated; 0 in the GPU files).
"""
from __future__ import annotations

from ..theory.pipeline import boundary_bytes
from .layouts import Layout
from .price_links import _Pricing


def stage_crossings(layout: Layout, first: bool, last: bool) -> int:
    """Stage boundaries one micro-batch crosses on this rank, forward and backward together:
    one stage per rank: [not first] + [not last]; V stages per rank: 2V less the two ends."""
    if layout.pipeline <= 1:
        return 0
    if layout.virtual_stages > 1:
        return max(0, 2 * layout.virtual_stages - (1 if first else 0) - (1 if last else 0))
    return int(not last) + int(not first)


def _pipeline_mb(cfg, layout: Layout, pr: _Pricing, seq: int, first: bool, last: bool, precision: str) -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's stage sends: each crossing
    moves :func:`~gridshard.theory.pipeline.boundary_bytes` in the compute dtype."""
    crossings = stage_crossings(layout, first, last)
    if not crossings:
        return 0.0, 0.0
    per = boundary_bytes(layout.tensor_mode, layout.sequence_parallel, layout.tensor, layout.micro_batch, seq,
                         cfg.hidden, dtype=precision)
    send, overhead = pr.hw.link(pr.levels["pipeline"], "send"), pr.hw.p2p_call_overhead_s
    return (send.seconds(per * crossings, crossings) + crossings * (pr.skew + overhead * pr.stretch),
            send.cpu_seconds(per * crossings, crossings) + crossings * overhead)


__all__ = ["stage_crossings"]
