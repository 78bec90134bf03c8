"""How long bytes take on the planner's links: which link each mesh dim uses, and the seconds (and
CPU seconds) of the collectives priced on it.

Each collective costs ``latency + ring wire bytes / bus bandwidth`` on its group's link (across
nodes the bus bandwidth of the group's members per node: :func:`group_ranks_per_node`),
plus ``Hardware.sync_skew_s`` per call: every collective the step prices here is synchronous
(tensor, ZeRO-3 gathers, exposed reductions, pipeline sends), and inside a step the ranks reach it
at different times — on an over-subscribed CPU about a scheduler slice per call, measured by
``--calibrate``; 0 in the GPU files. With gloo's small payloads this, with the latency, is what
2D's many SUMMA broadcasts/reduces cost (``calls × (latency + skew)``, from the
:mod:`~gridshard.tensor.tp2d.theory` call counts). The same calls' CPU seconds (the busy bound,
:mod:`.cost_time` "Two bounds"): ``LinkCost.cpu_seconds``.

:class:`_Pricing` carries one rank's links, compute stretch and sync skew to the pricing of each
mesh dim (:mod:`.price_tensor`, :mod:`.price_context`, :mod:`.price_pipeline`, :mod:`.price_data`)
and to :mod:`.cost_time`, which assembles the step.
"""
from __future__ import annotations

from typing import Optional
from dataclasses import dataclass

from ..comm.ledger import ring_wire_bytes
from ..theory import CommVolume
from .hardware import Hardware
from .layouts import Layout

FP32 = 4


def _ops(vols):
    """(op, ring wire bytes, calls, group size) of every kind of call in ``vols``."""
    for v in vols:
        if v is None:
            continue
        for op, payload in v.payload.items():
            yield op, ring_wire_bytes(op, payload, v.group_size), v.calls[op], v.group_size


def comm_seconds(vols, hw: Hardware, level: str, skew: Optional[float] = None, ranks_per_node: int = 1) -> float:
    """Σ over ops of calls·(latency + sync skew) + ring wire bytes / bus bandwidth (hardware module
    docstring): the collectives are synchronous, each exposed. ``skew``: per call, default
    ``hw.sync_skew_s``; ``ranks_per_node``: the group's members in each node (the bus bandwidth
    across nodes grows with the NICs they use: :meth:`~.hardware.LinkCost.bus_bandwidth`)."""
    skew = hw.sync_skew_s if skew is None else skew
    return sum(hw.link(level, op).seconds(wire, n, group, ranks_per_node) + n * skew
               for op, wire, n, group in _ops(vols))


def comm_cpu_seconds(vols, hw: Hardware, level: str, ranks_per_node: int = 1) -> float:
    """Σ over ops of the CPU seconds one rank spends in them (``LinkCost.cpu_seconds``)."""
    return sum(hw.link(level, op).cpu_seconds(wire, n, group, ranks_per_node) for op, wire, n, group in _ops(vols))


def call_seconds(hw: Hardware, level: str, op: str, payload: int, group: int, calls: int = 1,
                 skew: Optional[float] = None, cpu: bool = False) -> float:
    """One kind of small synchronous call, priced as :func:`comm_seconds` does; ``cpu``: its CPU
    seconds instead, as :func:`comm_cpu_seconds`."""
    if group <= 1 or not calls:
        return 0.0
    vols = [CommVolume(group).add(op, payload, calls)]
    return comm_cpu_seconds(vols, hw, level) if cpu else comm_seconds(vols, hw, level, skew)


def link_levels(layout: Layout, hw: Hardware, nodes: int) -> dict:
    """Which link each mesh dim uses: mesh order (data, pipeline, context, tensor), tensor innermost,
    ``devices_per_node`` consecutive ranks per node; the data reduction runs over data × context.
    At 2.5D the tensor dim is (depth, grid): the SUMMA group is one depth layer's q² consecutive
    ranks, and the reducer's data × context × depth group spans C·T ranks when D = 1. An MoE
    model's expert group (E > 1): :func:`expert_level`."""
    world, CT = layout.world, layout.context * layout.tensor
    per_node = max(1, world // max(1, nodes))
    inside = lambda span: "intra" if span <= per_node else "inter"  # noqa: E731
    levels = {"tensor": inside(layout.layer_tensor), "context": inside(CT), "pipeline": inside(CT * layout.pipeline),
              "data": inside(world if layout.data > 1 else CT)}
    if layout.expert > 1:                   # an MoE model's expert group
        levels["expert"] = expert_level(layout, per_node)
    axes = layout.mode.tensor_axis_levels(layout.layer_tensor, world, per_node)
    if axes is not None:                    # a mode whose tensor axes leave a node one by one (3D)
        levels["tensor_axes"] = axes
    return levels


def group_ranks_per_node(layout: Layout, per_node: int) -> dict:
    """Members of each collective group in one node of ``per_node`` consecutive ranks (mesh order
    data, pipeline, context, tensor; tensor innermost), for the bus bandwidth across nodes
    (hardware module docstring, "Bus bandwidth"): the tensor group's, as its scheme says
    (``tensor_ring_members_per_node``: 1D's T consecutive ranks, min(T, per_node); 1 for 2D/3D's
    axes); the data × context group has C context members T apart and D data members P·C·T apart,
    those of each inside one node multiplied. Other groups (pipeline and context sends, experts): 1."""
    T, C, P, D = layout.layer_tensor, layout.context, layout.pipeline, layout.data
    inside = lambda count, stride: min(count, max(1, per_node // stride)) if stride < per_node else 1  # noqa: E731
    return {"tensor": layout.mode.tensor_ring_members_per_node(T, per_node),
            "data": inside(C, T) * inside(D, P * C * T)}


def expert_span(layout: Layout) -> int:
    """Global ranks an expert group spans: E consecutive members of a data × context group
    (:mod:`gridshard.mesh_expert`), context members T ranks apart and data members P·C·T (mesh order
    data, pipeline, context, tensor): E·T when E ≤ C, else (E/C − 1)·P·C·T + C·T."""
    E, C, T, P = layout.expert, layout.context, layout.layer_tensor, layout.pipeline
    return E * T if E <= C else (E // C - 1) * P * C * T + C * T


def expert_level(layout: Layout, per_node: int) -> str:
    """``intra`` when the expert group fits in one node of ``per_node`` ranks, else ``inter``."""
    return "intra" if expert_span(layout) <= per_node else "inter"


@dataclass
class _Pricing:
    """How one rank's terms are priced: the link of each mesh dim, and on the critical path the
    compute stretch and the sync skew per call (1 and 0 on an over-subscribed node, whose
    contention is the throughput bound's; :mod:`.cost_time`, "Two bounds")."""

    hw: Hardware
    levels: dict
    stretch: float
    skew: float
    ranks_per_node: int
    members: dict = None          # group -> its members in one node (group_ranks_per_node)

    def members_of(self, group: str) -> int:
        return (self.members or {}).get(group, 1)


def _pricing(layout: Layout, hw: Hardware, nodes: int) -> _Pricing:
    ranks_per_node = max(1, layout.world // max(1, nodes))
    throughput_node = hw.oversubscribed(ranks_per_node)
    return _Pricing(hw, link_levels(layout, hw, nodes), 1.0 if throughput_node else hw.contention(ranks_per_node),
                    0.0 if throughput_node else hw.sync_skew_s, ranks_per_node,
                    group_ranks_per_node(layout, ranks_per_node))


__all__ = ["comm_seconds", "comm_cpu_seconds", "call_seconds", "link_levels", "expert_span", "expert_level",
           "group_ranks_per_node"]
