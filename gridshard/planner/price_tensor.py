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

Tensor-parallel collectives move elements of the run's **compute dtype** (2 bytes under bf16/fp16
autocast: the scheme's ``tensor_comm(..., e)``): 1D's activations
(:func:`gridshard.tensor.tp1d.cost.tensor_comm_1d`), as the runtime and Megatron send them, and the
2D / 2.5D / 3D products' panels, vectors and embedding blocks (:func:`gridshard.tensor.tp2d.cost.tensor_comm_2d`,
:func:`gridshard.tensor.tp3d.cost.tensor_comm_3d`); norm statistics and the loss stay fp32. (Priced
at 4 bytes, a bf16 block would cost twice its time on the link.)
"""
from __future__ import annotations

from ..theory.memory.activations import activation_element_bytes
from .layouts import Layout
from .price_links import _Pricing, comm_cpu_seconds, comm_seconds


def tensor_volumes(cfg, layout: Layout, seq: int, layers: int, first: bool, last: bool) -> list:
    """CommVolumes of one micro-batch's tensor-parallel collectives on a rank of ``layout`` (a layer
    layout: 2.5D is priced through :meth:`~gridshard.planner.layouts.Layout.layer_layout`, 2D's
    SUMMA on m/d rows)."""
    return [v for vols in layout.mode.tensor_comm(cfg, layout, seq, layers, first, last).values() for v in vols]


def _tensor_mb(cfg, layout: Layout, pr: _Pricing, seq: int, layers: int, first: bool, last: bool,
               precision: str = "fp32") -> tuple:
    """(critical-path seconds, busy CPU seconds) of one micro-batch's tensor-parallel collectives
    (in the compute dtype of ``precision``: module docstring)."""
    hw = pr.hw
    per_axis = layout.mode.tensor_comm(cfg, layout, seq, layers, first, last,      # axis → CommVolumes
                                       activation_element_bytes(precision))
    levels = pr.levels.get("tensor_axes", {})                                          # 3D: each axis its own link
    around = sum(sum(v.calls.values()) for vols in per_axis.values() for v in vols) * \
        hw.tensor_call_overhead_s.get(layout.tensor_mode, 0.0)
    k = pr.members_of("tensor")                                                       # 1D: its members per node
    return (sum(comm_seconds(vols, hw, levels.get(a, pr.levels["tensor"]), pr.skew, k) for a, vols in per_axis.items())
            + around * pr.stretch,
            sum(comm_cpu_seconds(vols, hw, levels.get(a, pr.levels["tensor"]), k) for a, vols in per_axis.items())
            + around)


__all__ = ["tensor_volumes"]
