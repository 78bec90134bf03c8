"""Predicted step time of a layout: compute, exposed communication per mesh dim, bubble.

Every count of FLOPs and bytes comes from :mod:`gridshard.theory` (the functions the ledger
tests assert); this module only prices them with a :class:`~gridshard.planner.hardware.Hardware`.
Notation: D, P, T (q = √T in 2D), A = global_batch/(m·D) micro-batches of m sequences of
s tokens, L_r the decoder layers of the slowest pipeline rank (its stages' layers).

Compute, per micro-batch on that rank (× the node's contention, ``Hardware.contention``,
where the node is not over-subscribed — see "Two bounds")::

    F_layer = flops_per_token(V=0, L=1)             (6·N_mm of one layer + 12·s·h)
    F_head  = flops_per_token(V, L=0)               (6·V·h, last stage only)
    F       = m·s·(L_r·F_layer + F_head)/T
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

Tensor communication (exposed: it sits between dependent matmuls), per micro-batch:
1D :func:`~gridshard.tensor.tp1d.theory.block_comm` per layer (+ embedding / final norm / head /
cross-entropy on the end stages; + :func:`~gridshard.tensor.tp1d.theory.block_recompute_comm` per
layer with full recompute); 2D the :mod:`~gridshard.tensor.tp2d.theory` pieces likewise (full
recompute repeats the q|k|v, o and gate|up forward products and the norms' forward reduce:
:func:`recompute2d_comm`, an adapter composed of ``summa_ab_comm``/``rmsnorm2d_comm``).
3D (T = q³, issue 24) the :mod:`~gridshard.tensor.tp3d.theory` block and ends (:func:`tensor_comm_3d`: every
projection a Linear3D — 8 calls, X, W and the product each moved about twice — the norms' statistics on
``output``, vectors and embedding on the q²-rank ``batch`` axes), each axis on its own link:
:func:`cube_axis_levels` says which axes' groups leave a node (``output`` innermost: q consecutive
ranks; ``input`` q²; ``weight`` and the flattened axes the whole cube). Compute is 1/T of the FLOPs
per rank (no SUMMA rounds: the contraction is the ``output`` reduce-scatter).
Each collective costs ``latency + ring wire bytes / bandwidth`` on the tensor group's link,
plus ``Hardware.sync_skew_s`` per call: every collective the step prices here is synchronous
(tensor, ZeRO-3 gathers, exposed reductions, pipeline sends), and inside a step the ranks reach it
at different times — on an over-subscribed CPU about a scheduler slice per call, measured by
``--calibrate``; 0 in the GPU files. With gloo's small payloads this, with the latency, is what
2D's many SUMMA broadcasts/reduces cost (``calls × (latency + skew)``, from the
:mod:`~gridshard.tensor.tp2d.theory` call counts).

Pipeline: each micro-batch crosses the rank's stage boundaries forward and backward,
:func:`~gridshard.theory.pipeline.boundary_bytes` each (``send`` link), exposed — the rank's
block of the hidden state (:meth:`gridshard.job_layout.TensorMode.boundary_block`: 1/T of it
under sequence parallelism, 1/q² in 2D, [m/q², s, h/q] = 1/T in 3D) in the run's compute dtype (``train.precision``: 2
bytes per element in bf16, as Megatron sends; theory.pipeline on what gridshard's autocast
runtime sends) — plus
``Hardware.p2p_call_overhead_s`` of schedule work per crossing (calibrated; 0 in the GPU files). The
schedule's idle share b = :func:`~gridshard.theory.pipeline.bubble_fraction`; with t_mb the
busy time of one micro-batch::

    t_pipeline = A·t_mb / (1 − b)        (bubble = A·t_mb·b/(1 − b));   P = 1: A·t_mb

Data parallelism, per step, on the data group's link (bytes:
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

Trainer bookkeeping (:func:`trainer_bookkeeping`, the calls of ``gridshard.engine.trainer``):
with a stop handler installed (``gridshard train`` installs one; ``control.stop_installed()``)
the trainer agrees on stopping with a one-element MAX all-reduce over the world after every
step on CPU (at log steps on GPUs): priced into ``overhead_s``. At log steps it all-gathers the
ranks' stats (4 float64 per rank) and all-reduces the losses over the data and pipeline groups;
the trainer's ``step_time_s`` is timed before them, so they are reported per step
(÷ ``log_interval``) in ``details["log_bookkeeping_s"]`` and kept out of the total.

Optimizer: AdamW streams 28 bytes per owned element (read param, grad, m, v; write param,
m, v) at ``memory_bandwidth``; plus ``step_overhead_s``.

    step = t_pipeline + exposed data comm + optimizer + step_overhead (+ stop agreement)

Tensor-parallel layers also cost CPU work around each collective that neither the FLOPs nor
the α–β see (autograd nodes, dispatch, copies): ``Hardware.tensor_call_overhead_s[mode]`` per
call of :mod:`~gridshard.theory` 's counts, measured by ``--calibrate`` (0 in the GPU files).

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

from typing import Optional
from dataclasses import dataclass, field

from ..comm.ledger import ring_wire_bytes
from ..job_layout import micro_batches_per_step
from ..theory import CommVolume
from ..theory import context as ctx_theory
from ..theory.pipeline import boundary_bytes, bubble_fraction
from ..theory.training import bucket_partition, dp_gradient_allreduce, flops_per_token
from ..theory.zero import reduces_in_backward, sharded_accumulation, unit_padded_numel, zero_step_comm
from .hardware import Hardware
from .layouts import Layout
from .memo import rank_blocks

FP32 = 4
ADAMW_BYTES_PER_ELEM = 28
ELEMENTWISE_PASSES = 3


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

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tensor_comm_s + self.pipeline_comm_s + self.data_comm_s + self.bubble_s
                + self.optimizer_s + self.overhead_s + self.context_comm_s)

    def as_dict(self) -> dict:
        return {"compute_s": self.compute_s, "tensor_comm_s": self.tensor_comm_s,
                "pipeline_comm_s": self.pipeline_comm_s, "data_comm_s": self.data_comm_s, "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s, "overhead_s": self.overhead_s, "context_comm_s": self.context_comm_s,
                "total_s": self.total_s}


# ---------------------------------------------------------------------------------------
# byte counts (theory functions, composed per pipeline stage)
# ---------------------------------------------------------------------------------------
def data_comm(cfg, layout: Layout, layer_ids, first: bool, last: bool, A: int, bucket_bytes: int):
    """(gradient-reduction CommVolume, after-step / in-step gather CommVolume, reduction units) of one step
    (over data × context: D·C ranks)."""
    D = layout.data * layout.context
    blocks = rank_blocks(cfg, layout.tensor_mode, layout.tensor, layer_ids, first, last)
    if D == 1:
        return None, None, 1
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
    reduce = type(vol)(D).add("reduce_scatter", vol.payload_bytes("reduce_scatter") // max(1, vol.count("reduce_scatter")),
                              vol.count("reduce_scatter"))
    gather = type(vol)(D).add("all_gather", vol.payload_bytes("all_gather") // max(1, vol.count("all_gather")),
                              vol.count("all_gather"))
    return reduce, gather, len(size)


# ---------------------------------------------------------------------------------------
# pricing
# ---------------------------------------------------------------------------------------
def _ops(vols):
    """(op, ring wire bytes, calls, group size) of every kind of call in ``vols``."""
    for v in vols:
        if v is None:
            continue
        for op, payload in v.payload.items():
            yield op, ring_wire_bytes(op, payload, v.group_size), v.calls[op], v.group_size


def comm_seconds(vols, hw: Hardware, level: str, skew: Optional[float] = None) -> float:
    """Σ over ops of calls·(latency + sync skew) + ring wire bytes / bandwidth (hardware module
    docstring): the collectives are synchronous, each exposed. ``skew``: per call, default
    ``hw.sync_skew_s``."""
    skew = hw.sync_skew_s if skew is None else skew
    return sum(hw.link(level, op).seconds(wire, n, group) + n * skew for op, wire, n, group in _ops(vols))


def comm_cpu_seconds(vols, hw: Hardware, level: str) -> float:
    """Σ over ops of the CPU seconds one rank spends in them (``LinkCost.cpu_seconds``)."""
    return sum(hw.link(level, op).cpu_seconds(wire, n, group) for op, wire, n, group in _ops(vols))


def call_seconds(hw: Hardware, level: str, op: str, payload: int, group: int, calls: int = 1,
                 skew: Optional[float] = None) -> float:
    """One kind of small synchronous call, priced as :func:`comm_seconds` does."""
    if group <= 1 or not calls:
        return 0.0
    return comm_seconds([CommVolume(group).add(op, payload, calls)], hw, level, skew)


def call_cpu_seconds(hw: Hardware, level: str, op: str, payload: int, group: int, calls: int = 1) -> float:
    """One kind of small call's CPU seconds, as :func:`comm_cpu_seconds`."""
    if group <= 1 or not calls:
        return 0.0
    return comm_cpu_seconds([CommVolume(group).add(op, payload, calls)], hw, level)


def trainer_bookkeeping(hw: Hardware, layout: Layout, level: str, stop_agreement: bool, log_interval: int,
                        skew: Optional[float] = None) -> tuple:
    """(seconds per step inside the timed step, seconds per step of the log-step collectives)
    of ``gridshard.engine.trainer``'s own calls (module docstring): the stop agreement (an
    all-reduce of 4 bytes over the world, every step, when a stop handler is installed); at log
    steps ``_gather_rank_stats`` (all-gather of 4 float64 per rank over the world) and
    ``_global_losses`` (all-reduce of the pending steps' float64 losses over data, then
    pipeline), ÷ ``log_interval``."""
    world = layout.world
    every = call_seconds(hw, level, "all_reduce", 4, world, skew=skew) if stop_agreement else 0.0
    n = max(1, log_interval)
    at_log = (call_seconds(hw, level, "all_gather", 32 * world, world)
              + call_seconds(hw, level, "all_reduce", 8 * n, layout.data * layout.context)
              + call_seconds(hw, level, "all_reduce", 8 * n, layout.pipeline))
    return every, at_log / n


def link_levels(layout: Layout, hw: Hardware, nodes: int) -> dict:
    """Which link each mesh dim uses: mesh order (data, pipeline, context, tensor), tensor innermost,
    ``devices_per_node`` consecutive ranks per node; the data reduction runs over data × context.
    At 2.5D the tensor dim is (depth, grid): the SUMMA group is one depth layer's q² consecutive
    ranks, and the reducer's data × context × depth group spans C·T ranks when D = 1."""
    world, CT = layout.world, layout.context * layout.tensor
    per_node = max(1, world // max(1, nodes))
    inside = lambda span: "intra" if span <= per_node else "inter"  # noqa: E731
    levels = {"tensor": inside(layout.layer_tensor), "context": inside(CT), "pipeline": inside(CT * layout.pipeline),
              "data": inside(world if layout.data > 1 else CT)}
    axes = layout.mode.tensor_axis_levels(layout.layer_tensor, world, per_node)
    if axes is not None:                    # a mode whose tensor axes leave a node one by one (3D)
        levels["tensor_axes"] = axes
    return levels


def gemm_flops(cfg, layout: Layout, seq: int) -> float:
    """FLOPs of one of the rank's gate|up GEMMs (the module docstring's G)."""
    N, h, f = layout.micro_batch * seq // layout.context, cfg.hidden, cfg.ffn_hidden
    return 2.0 * N * h * f / layout.mode.gemm_split(layout.tensor)


@dataclass
class RankCost:
    """One rank's step, two ways (module docstring, "Two bounds"): ``latency`` — the critical
    path, every term as priced above; ``busy`` — the seconds this rank keeps a core busy
    (compute, the CPU of its collectives, optimizer, overheads; no bubble, no waiting)."""

    latency: StepTime
    busy: StepTime


def _mean_steps(steps: list, scale: float) -> StepTime:
    """Component-wise mean of ``steps`` × ``scale``."""
    n = len(steps)
    keys = ("compute_s", "tensor_comm_s", "pipeline_comm_s", "data_comm_s", "bubble_s", "optimizer_s", "overhead_s",
            "context_comm_s")
    return StepTime(**{k: scale * sum(getattr(t, k) for t in steps) / n for k in keys})


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


def step_time(cfg, layout: Layout, hw: Hardware, *, seq_len: int, global_batch: int, precision: str = "fp32",
              nodes: int = 1, layer_ids=None, first: bool = True, last: bool = True, activation_bytes: int = 0,
              bucket_mb: float = 25.0, stop_agreement: bool = False, log_interval: int = 1) -> StepTime:
    """Predicted step time of the rank holding ``layer_ids`` (default all layers), module
    docstring; :func:`node_step` of this one rank's :func:`rank_cost`."""
    world = layout.world
    cost = rank_cost(cfg, layout, hw, seq_len=seq_len, global_batch=global_batch, precision=precision, nodes=nodes,
                     layer_ids=layer_ids, first=first, last=last, activation_bytes=activation_bytes,
                     bucket_mb=bucket_mb, stop_agreement=stop_agreement, log_interval=log_interval)
    return node_step([cost], hw, max(1, world // max(1, nodes)))


@dataclass
class _Pricing:
    """How one rank's terms are priced: the link of each mesh dim, and on the critical path the
    compute stretch and the sync skew per call (1 and 0 on an over-subscribed node, whose
    contention is the throughput bound's; module docstring, "Two bounds")."""

    hw: Hardware
    levels: dict
    stretch: float
    skew: float
    ranks_per_node: int


def _pricing(layout: Layout, hw: Hardware, nodes: int) -> _Pricing:
    world = layout.world
    ranks_per_node = max(1, world // max(1, nodes))
    throughput_node = hw.oversubscribed(ranks_per_node)
    return _Pricing(hw, link_levels(layout, hw, nodes), 1.0 if throughput_node else hw.contention(ranks_per_node),
                    0.0 if throughput_node else hw.sync_skew_s, ranks_per_node)


def microbatch_flops(cfg, layout: Layout, seq: int, layers: int, last: bool) -> float:
    """F of the module docstring: one micro-batch's FLOPs on a rank with ``layers`` decoder
    layers (+ the head when ``last``), with the recompute's extra forward; at C > 1 the rank's S/C
    tokens of each sequence, each attending over the whole sequence (÷ C)."""
    m, T, kvh = layout.micro_batch, layout.tensor, cfg.kv_heads * cfg.head_dim
    f_layer = flops_per_token(0, cfg.hidden, 1, cfg.ffn_hidden, seq, kvh)
    f_head = flops_per_token(cfg.vocab_size, cfg.hidden, 0, cfg.ffn_hidden, seq, kvh)
    flops = m * seq * (layers * f_layer + (f_head if last else 0.0)) / T
    if layout.recompute == "full":
        flops += m * seq * layers * f_layer / (3 * T)
    elif layout.recompute == "selective":
        core = f_layer - flops_per_token(0, cfg.hidden, 1, cfg.ffn_hidden, 0, kvh)
        flops += m * seq * layers * core / (3 * T)
    return flops / layout.context


def _compute_mb(cfg, layout: Layout, hw: Hardware, seq: int, layers: int, last: bool, precision: str,
                activation_bytes: int) -> tuple:
    """(seconds at full speed, FLOPs) of one micro-batch's compute: t_gemm + t_elem + t_ops."""
    flops = microbatch_flops(cfg, layout, seq, layers, last)
    t_gemm = flops / hw.flops_rate(precision, gemm_flops(cfg, layout, seq))
    passes = ELEMENTWISE_PASSES + (1 if layout.recompute == "full" else 0)      # full: the forward again
    t_elem = passes * activation_bytes / (hw.elementwise_bandwidth or hw.memory_bandwidth)
    t_ops = layers * hw.layer_overhead_s * (4.0 / 3.0 if layout.recompute == "full" else 1.0)
    return t_gemm + t_elem + t_ops, flops


def tensor_volumes(cfg, layout: Layout, seq: int, layers: int, first: bool, last: bool) -> list:
    """CommVolumes of one micro-batch's tensor-parallel collectives on a rank of ``layout`` (a layer
    layout: 2.5D is priced through :meth:`~gridshard.planner.layouts.Layout.layer_layout`, 2D's
    SUMMA on m/d rows)."""
    return [v for vols in layout.mode.tensor_comm(cfg, layout, seq, layers, first, last).values() for v in vols]


def _tensor_mb(cfg, layout: Layout, pr: _Pricing, seq: int, layers: int, first: bool, last: bool) -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's tensor-parallel collectives."""
    hw = pr.hw
    per_axis = layout.mode.tensor_comm(cfg, layout, seq, layers, first, last)       # axis → CommVolumes
    levels = pr.levels.get("tensor_axes", {})                                          # 3D: each axis its own link
    around = sum(sum(v.calls.values()) for vols in per_axis.values() for v in vols) * \
        hw.tensor_call_overhead_s.get(layout.tensor_mode, 0.0)
    return (sum(comm_seconds(vols, hw, levels.get(a, pr.levels["tensor"]), pr.skew) for a, vols in per_axis.items())
            + around * pr.stretch,
            sum(comm_cpu_seconds(vols, hw, levels.get(a, pr.levels["tensor"])) for a, vols in per_axis.items())
            + around)


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
    level, hw = pr.levels["data"], pr.hw
    out = _DataCost(busy_s=comm_cpu_seconds([gather, reduce], hw, level))     # (None: no such calls)
    if gather is not None:
        t_gather = comm_seconds([gather], hw, level, pr.skew)
        if layout.zero == 3:
            out.gather_per_mb_s = t_gather / A          # per micro-batch (its layer gathers)
        else:
            out.gather_after_s = t_gather
    out.reduce_s = comm_seconds([reduce], hw, level, pr.skew)
    D = layout.data * layout.context
    ov = layout.overlap_grad_reduce                 # train.overlap_grad_reduce (the planner enumerates it)
    in_backward = reduces_in_backward(layout.zero, D, layout.pipeline, layout.pipeline_schedule, ov)
    # sharded accumulation: each micro-batch's reduce-scatters hide under that micro-batch's backward
    waves = A if sharded_accumulation(layout.zero, D, layout.pipeline, layout.pipeline_schedule, ov) else 1
    hide = hw.dp_overlap * (2.0 / 3.0) * compute_mb * waves if in_backward else 0.0
    if out.reduce_s:
        out.exposed_reduce_s = max(out.reduce_s - hide, out.reduce_s / max(1, units) / waves)
    return out


def _step_extras(cfg, layout: Layout, pr: _Pricing, layer_ids, first: bool, last: bool, stop_agreement: bool,
                 log_interval: int) -> dict:
    """Per-step terms outside the micro-batches: AdamW over the owned elements, the small
    norm all-reduces and the trainer's bookkeeping, on the critical path and as busy CPU."""
    hw, levels, T = pr.hw, pr.levels, layout.tensor
    blocks = rank_blocks(cfg, layout.tensor_mode, T, layer_ids, first, last)
    owned = sum(b.numel for b in blocks) / (layout.data * layout.context if layout.zero >= 1 else 1)
    small_calls = [("tensor", T), ("pipeline", layout.pipeline), ("data", layout.data * layout.context)]
    stop_s, log_s = trainer_bookkeeping(hw, layout, levels["data"], stop_agreement, log_interval, skew=pr.skew)
    world = layout.world
    return {"busy_opt": ADAMW_BYTES_PER_ELEM * owned / hw.memory_bandwidth,
            "small": sum(call_seconds(hw, levels[d], "all_reduce", 8, n, skew=pr.skew) for d, n in small_calls),
            "busy_small": sum(call_cpu_seconds(hw, levels[d], "all_reduce", 8, n) for d, n in small_calls),
            "stop": stop_s, "log": log_s,
            "busy_stop": call_cpu_seconds(hw, levels["data"], "all_reduce", 4, world) if stop_agreement else 0.0}


def rank_cost(cfg, layout: Layout, hw: Hardware, *, seq_len: int, global_batch: int, precision: str = "fp32",
              nodes: int = 1, layer_ids=None, first: bool = True, last: bool = True, activation_bytes: int = 0,
              bucket_mb: float = 25.0, stop_agreement: bool = False, log_interval: int = 1) -> RankCost:
    """Critical path and busy time of the rank holding ``layer_ids`` (module docstring). On an
    over-subscribed node the critical path is priced at full speed and without the sync skew
    (the contention is the throughput bound's), elsewhere with the node's contention (1 on GPUs).
    A 2.5D layout (d depth layers of a q×q grid): the links are its job mesh's (:func:`link_levels`),
    every term the 2D layer layout's (:meth:`~gridshard.planner.layouts.Layout.layer_layout`):
    compute and SUMMA comm of 2D on q² ranks with m/d rows, the reduction over D·C·d ranks."""
    pr = _pricing(layout, hw, nodes)
    depth, layout = layout.tensor_depth, layout.layer_layout()
    s, P, s_r = seq_len, layout.pipeline, seq_len // layout.context       # s_r: the rank's tokens of a sequence
    A = micro_batches_per_step(global_batch, layout.micro_batch, layout.data)
    layers = cfg.layers if layer_ids is None else len(layer_ids)
    busy_compute_mb, flops = _compute_mb(cfg, layout, hw, s, layers, last, precision, activation_bytes)
    compute_mb = busy_compute_mb * pr.stretch
    t_tensor_mb, busy_tensor_mb = _tensor_mb(cfg, layout, pr, s_r, layers, first, last)
    t_p2p_mb, busy_p2p_mb = _pipeline_mb(cfg, layout, pr, s_r, first, last, precision)
    t_ctx_mb, busy_ctx_mb = _context_mb(cfg, layout, pr, s, layers, precision)
    data = _data_step(cfg, layout, pr, layer_ids, first, last, A, int(bucket_mb * (1 << 20)), compute_mb)
    t_mb = compute_mb + t_tensor_mb + t_p2p_mb + t_ctx_mb + data.gather_per_mb_s
    bubble = bubble_fraction(P, A, layout.pipeline_schedule, layout.virtual_stages) if P > 1 else 0.0
    bubble_s = A * t_mb * bubble / (1.0 - bubble) if P > 1 else 0.0
    x = _step_extras(cfg, layout, pr, layer_ids, first, last, stop_agreement, log_interval)
    latency = StepTime(compute_s=A * compute_mb, tensor_comm_s=A * t_tensor_mb, pipeline_comm_s=A * t_p2p_mb,
                       data_comm_s=data.exposed_reduce_s + data.gather_after_s + A * data.gather_per_mb_s,
                       bubble_s=bubble_s, optimizer_s=x["busy_opt"] * pr.stretch,
                       overhead_s=hw.step_overhead_s * pr.stretch + x["small"] + x["stop"], context_comm_s=A * t_ctx_mb,
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
                    overhead_s=hw.step_overhead_s + x["busy_small"] + x["busy_stop"], context_comm_s=A * busy_ctx_mb)
    return RankCost(latency, busy)


__all__ = ["StepTime", "RankCost", "step_time", "rank_cost", "node_step",
           "microbatch_flops", "stage_crossings", "tensor_volumes", "comm_cpu_seconds",
           "data_comm", "comm_seconds", "call_seconds", "trainer_bookkeeping", "link_levels",
           "gemm_flops"]
