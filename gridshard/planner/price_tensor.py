"""Tensor-parallel communication of one micro-batch on a rank (exposed: it sits between dependent
matmuls).

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
Each collective is priced on the tensor group's link (:mod:`.price_links`: latency + ring wire
bytes / bandwidth + sync skew per call).

Tensor-parallel layers also cost CPU work around each collective that neither the FLOPs nor
the α–β see (autograd nodes, dispatch, copies): ``Hardware.tensor_call_overhead_s[mode]`` per
call of :mod:`~gridshard.theory` 's counts, measured by ``--calibrate`` (0 in the GPU files).

1D's activation collectives move elements of the run's **compute dtype** (:func:`tensor_comm_1d_dtype`):
under bf16/fp16 autocast gridshard's residual stream, the norms' outputs and the projections are in
that dtype (:mod:`gridshard.models.llama`, "Precision"), so the row layers' output all-reduces and the
column layers' input-gradient all-reduces (and SP's gathers / reduce-scatters) carry 2-byte elements,
as Megatron's do; the cross-entropy statistics and the parameter-gradient all-reduces (norm weights
under SP, replicated k/v weights) stay fp32. :func:`gridshard.tensor.tp1d.cost.tensor_comm_1d` builds
the fp32 volumes (``bytes_per_elem`` 4); the planner priced them at 4 bytes under bf16 until issue 43,
twice the bytes: an 8-way all-reduce of a bf16 block then cost 2 × 1.75·S / bandwidth, half the
published bus bandwidth per byte moved. The call counts are the theory's (:func:`tensor_volumes`).
"""
from __future__ import annotations

from ..tensor.tp1d import theory as tp1d
from ..theory.memory.activations import activation_element_bytes
from .layouts import Layout
from .price_links import _Pricing, comm_cpu_seconds, comm_seconds

FP32 = 4


def tensor_volumes(cfg, layout: Layout, seq: int, layers: int, first: bool, last: bool) -> list:
    """CommVolumes of one micro-batch's tensor-parallel collectives on a rank of ``layout`` (a layer
    layout: 2.5D is priced through :meth:`~gridshard.planner.layouts.Layout.layer_layout`, 2D's
    SUMMA on m/d rows)."""
    return [v for vols in layout.mode.tensor_comm(cfg, layout, seq, layers, first, last).values() for v in vols]


def tensor_comm_1d_dtype(cfg, layout: Layout, seq: int, layers: int, first: bool, last: bool, e: int) -> list:
    """:func:`gridshard.tensor.tp1d.cost.tensor_comm_1d`'s volumes with the activations in ``e``-byte
    elements (module docstring): the column/row pairs, embedding and head in ``e`` bytes; the norm-weight
    and replicated k/v weight-gradient all-reduces and the cross-entropy statistics in fp32. At e = 4 the
    same volumes as ``tensor_comm_1d``."""
    T, sp, m, h = layout.tensor, layout.sequence_parallel, layout.micro_batch, cfg.hidden
    pair = tp1d.column_row_comm(m, seq, h, T, sp, e)
    norm = tp1d.norm_comm(h, T, sp, FP32)
    block = pair + pair + norm + norm
    gqa = tp1d._gqa(h, cfg.heads, cfg.kv_heads)
    if gqa is not None and T > gqa[1]:
        block.add("all_reduce", gqa[0] * h * FP32, 2)
    vols = [block] * layers
    if layout.recompute == "full":
        vols += [tp1d.block_recompute_comm(m, seq, h, T, sp, e)] * layers
    if first:
        vols.append(tp1d.embedding_comm(m, seq, h, T, sp, e))
    if last:
        vols += [tp1d.norm_comm(h, T, sp, FP32), tp1d.head_comm(m, seq, h, T, sp, e), tp1d.cross_entropy_comm(m * seq, T)]
    return vols


def _tensor_mb(cfg, layout: Layout, pr: _Pricing, seq: int, layers: int, first: bool, last: bool,
               precision: str = "fp32") -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's tensor-parallel collectives
    (1D's activations in the compute dtype of ``precision``: module docstring)."""
    hw = pr.hw
    per_axis = layout.mode.tensor_comm(cfg, layout, seq, layers, first, last)       # axis → CommVolumes
    e = activation_element_bytes(precision)
    if layout.tensor_mode == "1d" and layout.tensor > 1 and e != FP32:
        per_axis = {"tensor": tensor_comm_1d_dtype(cfg, layout, seq, layers, first, last, e)}
    levels = pr.levels.get("tensor_axes", {})                                          # 3D: each axis its own link
    around = sum(sum(v.calls.values()) for vols in per_axis.values() for v in vols) * \
        hw.tensor_call_overhead_s.get(layout.tensor_mode, 0.0)
    k = pr.members_of("tensor")                                                       # 1D: its members per node
    return (sum(comm_seconds(vols, hw, levels.get(a, pr.levels["tensor"]), pr.skew, k) for a, vols in per_axis.items())
            + around * pr.stretch,
            sum(comm_cpu_seconds(vols, hw, levels.get(a, pr.levels["tensor"]), k) for a, vols in per_axis.items())
            + around)


__all__ = ["tensor_volumes", "tensor_comm_1d_dtype"]
