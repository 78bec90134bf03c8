"""Predicted step time of a layout: compute, exposed communication per mesh dim, bubble.

Every count of FLOPs and bytes comes from :mod:`gridshard.theory` (the functions the ledger
tests assert); this module only prices them with a :class:`~gridshard.planner.hardware.Hardware`.
Notation: D, P, T (q = √T in 2D), A = global_batch/(m·D) micro-batches of m sequences of
s tokens, L_r the decoder layers of the slowest pipeline rank (its stages' layers).

Each term is priced in its own module, with its math, and assembled here (:func:`rank_cost`):

* compute per micro-batch (t_gemm + t_elem + t_ops): :mod:`.price_compute`;
* tensor communication per micro-batch (exposed: it sits between dependent matmuls): :mod:`.price_tensor`;
* context communication per micro-batch (C > 1): :mod:`.price_context`;
* an MoE model's dispatch and combine per micro-batch (E > 1) and its active FLOPs: :mod:`.price_expert`;
* pipeline stage sends per micro-batch: :mod:`.price_pipeline`;
* data parallelism per step (the gradient reduction, ZeRO's gathers): :mod:`.price_data`;
* which link each mesh dim uses, and a collective's seconds on it (latency + ring wire bytes /
  bandwidth + sync skew per call): :mod:`.price_links`.

Pipeline: the schedule's idle share b = :func:`~gridshard.theory.pipeline.bubble_fraction`; with t_mb the
busy time of one micro-batch::

    t_pipeline = A·t_mb / (1 − b)        (bubble = A·t_mb·b/(1 − b));   P = 1: A·t_mb

Trainer bookkeeping (:func:`_step_extras`, the calls of ``gridshard.engine.trainer``):
with a stop handler installed (``gridshard train`` installs one; ``control.stop_installed()``)
the trainer agrees on stopping with a one-element MAX all-reduce over the world after every
step on CPU (at log steps on GPUs): priced into ``overhead_s``. At log steps it all-gathers the
ranks' stats (4 float64 per rank) and all-reduces the losses over the data and pipeline groups;
the trainer's ``step_time_s`` is timed before them, so they are reported per step
(÷ ``log_interval``) in ``details["log_bookkeeping_s"]`` and kept out of the total.

Optimizer: AdamW streams 28 bytes per owned element (read param, grad, m, v; write param,
m, v) at ``memory_bandwidth``; plus ``step_overhead_s``.

    step = t_pipeline + exposed data comm + optimizer + step_overhead (+ stop agreement)

Two bounds
----------
Everything above is the **critical path** of a rank (:class:`RankCost` ``.latency``). When a
node holds more ranks than compute slots (CPU ranks on a few cores, r > slots:
``Hardware.oversubscribed``) the cores are the bottleneck instead: a rank waiting in a
collective or a pipeline bubble leaves its core to another. Measured here (2 cores, gloo):
Σ over the ranks of process CPU seconds per step ÷ wall seconds is 2.0 at 8 ranks and
1.65–1.9 at 4, for every layout tried. So each rank also gets a **busy** time (``.busy``) —
what it keeps a core busy per step, all at full speed::

    busy = A·(t_gemm + t_elem + t_ops + tensor calls' CPU + sends' CPU)
         + gradient reduction's and gathers' CPU (nothing hidden: the CPU is what is short)
         + optimizer + step_overhead + the small all-reduces' CPU

(a collective's CPU seconds: ``LinkCost.cpu_seconds``), and on such a node the critical path
is priced at full speed without the sync skew (stretch 1: the contention belongs to the other
bound). :func:`node_step` takes the larger of

    critical path of the slowest pipeline rank,
    throughput bound = mean busy over the pipeline ranks × r / slots

(every pipeline stage has D·T ranks; a bubble costs nothing in the throughput bound, the idle
ranks' cores run the others). On GPU nodes (a device per rank) only the critical path exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..job_layout import micro_batches_per_step
from ..theory.pipeline import bubble_fraction
from .hardware import Hardware
from .layouts import Layout
from .memo import rank_blocks
from .price_compute import _compute_mb, gemm_flops
from .price_context import _context_mb
from .price_data import _data_step
from .price_expert import _expert_mb, moe_layer_count
from .price_links import _Pricing, _pricing, call_seconds
from .price_pipeline import _pipeline_mb
from .price_tensor import _tensor_mb, tensor_volumes

ADAMW_BYTES_PER_ELEM = 28
STEP_PARTS = ("compute_s", "tensor_comm_s", "pipeline_comm_s", "data_comm_s", "bubble_s", "optimizer_s", "overhead_s",
              "context_comm_s", "expert_comm_s")            # the seconds a StepTime adds up, in this order


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, split by cause."""

    compute_s: float
    tensor_comm_s: float
    pipeline_comm_s: float
    data_comm_s: float          # exposed
    bubble_s: float
    optimizer_s: float
    overhead_s: float
    details: dict = field(default_factory=dict)
    context_comm_s: float = 0.0  # exposed ring sends / all-to-alls (C > 1)
    expert_comm_s: float = 0.0   # an MoE model's dispatch and combine (E > 1)

    @property
    def total_s(self) -> float:
        return sum(getattr(self, k) for k in STEP_PARTS)

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in STEP_PARTS}, "total_s": self.total_s}


@dataclass
class RankCost:
    """One rank's step, two ways (module docstring, "Two bounds"): ``latency`` — the critical
    path, every term as priced above; ``busy`` — the seconds this rank keeps a core busy
    (compute, the CPU of its collectives, optimizer, overheads; no bubble, no waiting)."""

    latency: StepTime
    busy: StepTime


def _mean_steps(steps: list, scale: float) -> StepTime:
    """Component-wise mean of ``steps`` × ``scale``."""
    return StepTime(**{k: scale * sum(getattr(t, k) for t in steps) / len(steps) for k in STEP_PARTS})


def node_step(ranks: list, hw: Hardware, ranks_per_node: int) -> StepTime:
    """The step of a layout from its pipeline ranks' :class:`RankCost` (module docstring):
    the slowest rank's critical path, or — on an over-subscribed node, when larger — the
    ranks' mean busy time × ranks_per_node / slots (every stage has the same number of ranks)."""
    worst = max((r.latency for r in ranks), key=lambda t: t.total_s)
    if not hw.oversubscribed(ranks_per_node):
        worst.details["regime"] = "latency"
        return worst
    stretch = hw.contention(ranks_per_node)
    through = _mean_steps([r.busy for r in ranks], stretch)
    bound = {"latency_bound_s": worst.total_s, "throughput_bound_s": through.total_s, "contention": stretch}
    if worst.total_s >= through.total_s:
        worst.details.update(bound, regime="latency")
        return worst
    through.details = dict(worst.details, **bound, regime="throughput")
    return through


def step_time(cfg, layout: Layout, hw: Hardware, *, nodes: int = 1, **keywords) -> StepTime:
    """Predicted step time of the rank holding ``layer_ids`` (default all layers), module
    docstring; :func:`node_step` of this one rank's :func:`rank_cost` (``keywords``: its own)."""
    cost = rank_cost(cfg, layout, hw, nodes=nodes, **keywords)
    return node_step([cost], hw, max(1, layout.world // max(1, nodes)))


def _step_extras(cfg, layout: Layout, pr: _Pricing, layer_ids, first: bool, last: bool, stop_agreement: bool,
                 log_interval: int) -> dict:
    """Per-step terms outside the micro-batches: AdamW over the owned elements, the small
    norm all-reduces and the trainer's bookkeeping, on the critical path and as busy CPU.

    The bookkeeping is ``gridshard.engine.trainer``'s own calls (module docstring): the stop
    agreement (an all-reduce of 4 bytes over the world, every step, when a stop handler is
    installed: ``stop``); at log steps ``_gather_rank_stats`` (all-gather of 4 float64 per rank
    over the world) and ``_global_losses`` (all-reduce of the pending steps' float64 losses over
    data, then pipeline), ÷ ``log_interval`` (``log``)."""
    hw, levels, T, world, level = pr.hw, pr.levels, layout.tensor, layout.world, pr.levels["data"]
    R, E = layout.data * layout.context, layout.expert
    blocks = rank_blocks(cfg, layout.tensor_mode, T, layer_ids, first, last, E)
    owned = sum(b.numel / ((R // E if b.expert else R) if layout.zero >= 1 else 1) for b in blocks)
    small_calls = [("tensor", T), ("pipeline", layout.pipeline), ("data", layout.data * layout.context)]
    logs = max(1, log_interval)           # steps between log steps: the pending losses
    at_log = (call_seconds(hw, level, "all_gather", 32 * world, world)
              + call_seconds(hw, level, "all_reduce", 8 * logs, layout.data * layout.context)
              + call_seconds(hw, level, "all_reduce", 8 * logs, layout.pipeline))
    return {"busy_opt": ADAMW_BYTES_PER_ELEM * owned / hw.memory_bandwidth,
            "small": sum(call_seconds(hw, levels[d], "all_reduce", 8, n, skew=pr.skew) for d, n in small_calls),
            "busy_small": sum(call_seconds(hw, levels[d], "all_reduce", 8, n, cpu=True) for d, n in small_calls),
            "stop": call_seconds(hw, level, "all_reduce", 4, world, skew=pr.skew) if stop_agreement else 0.0,
            "log": at_log / logs,
            "busy_stop": call_seconds(hw, level, "all_reduce", 4, world, cpu=True) if stop_agreement else 0.0}


def rank_cost(cfg, layout: Layout, hw: Hardware, *, seq_len: int, global_batch: int, precision: str = "fp32",
              nodes: int = 1, layer_ids=None, first: bool = True, last: bool = True, activation_bytes: int = 0,
              bucket_mb: float = 25.0, stop_agreement: bool = False, log_interval: int = 1) -> RankCost:
    """Critical path and busy time of the rank holding ``layer_ids`` (module docstring). On an
    over-subscribed node the critical path is priced at full speed and without the sync skew
    (the contention is the throughput bound's), elsewhere with the node's contention (1 on GPUs).
    A 2.5D layout (d depth layers of a q×q grid): the links are its job mesh's (:func:`~.price_links.link_levels`),
    every term the 2D layer layout's (:meth:`~gridshard.planner.layouts.Layout.layer_layout`):
    compute and SUMMA comm of 2D on q² ranks with m/d rows, the reduction over D·C·d ranks."""
    pr = _pricing(layout, hw, nodes)
    depth, layout = layout.tensor_depth, layout.layer_layout()
    s, P, s_r = seq_len, layout.pipeline, seq_len // layout.context       # s_r: the rank's tokens of a sequence
    A = micro_batches_per_step(global_batch, layout.micro_batch, layout.data)
    layers = cfg.layers if layer_ids is None else len(layer_ids)
    moe_layers = moe_layer_count(cfg, layer_ids)
    busy_compute_mb, flops = _compute_mb(cfg, layout, hw, s, layers, last, precision, activation_bytes, moe_layers)
    compute_mb = busy_compute_mb * pr.stretch
    t_tensor_mb, busy_tensor_mb = _tensor_mb(cfg, layout, pr, s_r, layers, first, last, precision)
    t_p2p_mb, busy_p2p_mb = _pipeline_mb(cfg, layout, pr, s_r, first, last, precision)
    t_ctx_mb, busy_ctx_mb = _context_mb(cfg, layout, pr, s, layers, precision)
    t_exp_mb, busy_exp_mb = _expert_mb(cfg, layout, pr, s, layer_ids, precision)
    data = _data_step(cfg, layout, pr, layer_ids, first, last, A, int(bucket_mb * (1 << 20)), compute_mb)
    t_mb = compute_mb + t_tensor_mb + t_p2p_mb + t_ctx_mb + t_exp_mb + data.gather_per_mb_s
    bubble = bubble_fraction(P, A, layout.pipeline_schedule, layout.virtual_stages) if P > 1 else 0.0
    bubble_s = A * t_mb * bubble / (1.0 - bubble) if P > 1 else 0.0
    x = _step_extras(cfg, layout, pr, layer_ids, first, last, stop_agreement, log_interval)
    latency = StepTime(compute_s=A * compute_mb, tensor_comm_s=A * t_tensor_mb, pipeline_comm_s=A * t_p2p_mb,
                       data_comm_s=data.exposed_reduce_s + data.gather_after_s + A * data.gather_per_mb_s,
                       bubble_s=bubble_s, optimizer_s=x["busy_opt"] * pr.stretch,
                       overhead_s=hw.step_overhead_s * pr.stretch + x["small"] + x["stop"], context_comm_s=A * t_ctx_mb,
                       expert_comm_s=A * t_exp_mb,
                       details={"micro_batches": A, "bubble_fraction": bubble, "links": pr.levels,
                                "contention": hw.contention(pr.ranks_per_node),
                                "gemm_flops": gemm_flops(cfg, layout, s), "flops_per_microbatch": flops,
                                "data_reduce_s": data.reduce_s,
                                "data_reduce_hidden_s": data.reduce_s - data.exposed_reduce_s,
                                "zero3_gather_s": A * data.gather_per_mb_s, "stop_agreement_s": x["stop"],
                                "log_bookkeeping_s": x["log"], "tensor_depth": depth,
                                "tensor_calls_per_microbatch": sum(sum(v.calls.values()) for v in tensor_volumes(
                                    cfg, layout, s_r, layers, first, last))})
    busy = StepTime(compute_s=A * busy_compute_mb, tensor_comm_s=A * busy_tensor_mb, pipeline_comm_s=A * busy_p2p_mb,
                    data_comm_s=data.busy_s, bubble_s=0.0, optimizer_s=x["busy_opt"],
                    overhead_s=hw.step_overhead_s + x["busy_small"] + x["busy_stop"], context_comm_s=A * busy_ctx_mb,
                    expert_comm_s=A * busy_exp_mb)
    return RankCost(latency, busy)


__all__ = ["StepTime", "RankCost", "step_time", "rank_cost", "node_step"]
