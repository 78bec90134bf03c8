"""The hardware model the planner prices a layout with: compute rate, memory, links.

A :class:`Hardware` is read from a JSON file — one of the packaged ones
(``gridshard/planner/hardware/{h100,h200,a100,cpu}.json``, datasheet figures with their
sources inside the file) or a profile written by ``gridshard plan --calibrate``.

Compute
-------
A GEMM of F = 2·m·k·n FLOPs runs at ``peak_flops[precision] · efficiency(F)``, with
``efficiency`` interpolated log-linearly in F between the file's ``gemm_efficiency``
points ``[[F, eff], ...]`` (clamped at both ends). Work that is not a GEMM is priced as

* ``layer_overhead_s`` per decoder layer and micro-batch (operator dispatch, kernel launches,
  the small element-wise kernels of norms/RoPE/SiLU at small sizes);
* ``step_overhead_s`` per optimizer step (loop, clipping, bookkeeping);
* bytes streamed through memory at ``memory_bandwidth`` (element-wise traffic, AdamW).

``compute_slots_per_node``: how many ranks of one node compute at full rate at the same
time (a GPU per rank: = ``devices_per_node``; a CPU: the cores, or the calibrated
effective number). With r ranks on a node every compute term is stretched by
max(1, r / slots).

Links
-----
``links[level][op] = {"bandwidth": B/s, "latency_s": s}`` for level ``intra`` (inside a
node) and ``inter`` (across nodes), op ∈ all_reduce, all_gather, reduce_scatter,
broadcast, reduce, send (``default`` for any op not listed). One collective on a group of
n ranks moving wire bytes W (:func:`gridshard.comm.ledger.ring_wire_bytes`, the bytes a rank
sends on a ring) costs ``latency_s + latency_per_rank_s·(n − 2) + W / bandwidth`` (the α–β
model, latency measured at n = 2 and growing with the ring's steps; ``bandwidth`` is the *achieved*
algorithm bandwidth per rank, not the raw link rate: the data files derate the
datasheet's link rate by ``link_efficiency``).

``sync_skew_s`` (default 0): the extra wait of one *synchronous* collective inside a training
step over its isolated α–β cost — the ranks reach it at different times. On a GPU node (a device
per rank) this is small and left 0; on an over-subscribed CPU (more ranks than cores) a rank
that arrives waits for its peers to be scheduled and finish their share of the compute
before it, about a scheduler time slice per call. ``gridshard plan --calibrate`` measures it
(calibrate module docstring); the planner adds it once per exposed call (cost_time).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send")
GIB = 1 << 30


@dataclass
class LinkCost:
    """α–β cost of one collective kind on one link level."""

    bandwidth: float          # achieved bytes/s per rank (wire bytes)
    latency_s: float          # per call, on 2 ranks
    latency_per_rank_s: float = 0.0

    def seconds(self, wire_bytes: float, calls: int = 1, group_size: int = 2) -> float:
        if not calls:
            return 0.0
        latency = self.latency_s + self.latency_per_rank_s * max(0, group_size - 2)
        return calls * latency + wire_bytes / self.bandwidth


@dataclass
class Hardware:
    """One device kind and its interconnect (module docstring)."""

    name: str
    device_memory_bytes: int
    peak_flops: dict                       # precision -> FLOP/s per device
    gemm_efficiency: list                  # [[gemm FLOPs, efficiency], ...], increasing FLOPs
    memory_bandwidth: float                # bytes/s
    links: dict                            # level -> op -> LinkCost
    devices_per_node: int = 8
    compute_slots_per_node: Optional[float] = None
    reserved_bytes: int = 0                # runtime footprint not modelled (CUDA context, NCCL, Python)
    margin_fraction: float = 0.10          # safety margin on the modelled bytes
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    dp_overlap: float = 1.0                # share of the last backward a gradient reduction can hide under
    sync_skew_s: float = 0.0               # extra wait per synchronous collective inside a training step
    sources: list = field(default_factory=list)
    notes: str = ""

    # ---- compute -----------------------------------------------------------------------
    def flops_rate(self, precision: str, gemm_flops: float) -> float:
        """Achieved FLOP/s of one GEMM of ``gemm_flops`` FLOPs (module docstring)."""
        peak = self.peak_flops.get(precision) or self.peak_flops["fp32"]
        return peak * self.efficiency(gemm_flops)

    def efficiency(self, gemm_flops: float) -> float:
        pts = self.gemm_efficiency
        if gemm_flops <= pts[0][0]:
            return pts[0][1]
        if gemm_flops >= pts[-1][0]:
            return pts[-1][1]
        for (f0, e0), (f1, e1) in zip(pts, pts[1:]):
            if f0 <= gemm_flops <= f1:
                w = (math.log(gemm_flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    def contention(self, ranks_per_node: int) -> float:
        """Stretch of every compute term when ``ranks_per_node`` ranks share a node."""
        slots = self.compute_slots_per_node or self.devices_per_node
        return max(1.0, ranks_per_node / slots)

    # ---- communication -----------------------------------------------------------------
    def link(self, level: str, op: str) -> LinkCost:
        table = self.links.get(level) or self.links["intra"]
        return table.get(op) or table["default"]


def _link_table(raw: dict) -> dict:
    out = {}
    for level, ops in raw.items():
        out[level] = {op: LinkCost(float(v["bandwidth"]), float(v["latency_s"]), float(v.get("latency_per_rank_s", 0)))
                      for op, v in ops.items() if isinstance(v, dict)}
        if "default" not in out[level]:
            raise ConfigError(f"hardware links.{level} has no 'default' entry. Fix: add "
                              f"\"default\": {{\"bandwidth\": ..., \"latency_s\": ...}}.")
    if "intra" not in out:
        raise ConfigError("hardware file has no links.intra section. Fix: describe the link inside a node.")
    return out


def hardware_from_dict(raw: dict) -> Hardware:
    try:
        return Hardware(
            name=raw["name"], device_memory_bytes=int(raw["device_memory_bytes"]),
            peak_flops={k: float(v) for k, v in raw["peak_flops"].items()},
            gemm_efficiency=sorted([float(f), float(e)] for f, e in raw["gemm_efficiency"]),
            memory_bandwidth=float(raw["memory_bandwidth"]), links=_link_table(raw["links"]),
            devices_per_node=int(raw.get("devices_per_node", 8)),
            compute_slots_per_node=raw.get("compute_slots_per_node"),
            reserved_bytes=int(raw.get("reserved_bytes", 0)), margin_fraction=float(raw.get("margin_fraction", 0.10)),
            layer_overhead_s=float(raw.get("layer_overhead_s", 0.0)), step_overhead_s=float(raw.get("step_overhead_s", 0.0)),
            dp_overlap=float(raw.get("dp_overlap", 1.0)), sync_skew_s=float(raw.get("sync_skew_s", 0.0)),
            sources=list(raw.get("sources", [])),
            notes=raw.get("notes", ""))
    except KeyError as e:
        raise ConfigError(f"hardware description lacks the field {e.args[0]!r}. Fix: see "
                          f"gridshard/planner/hardware/h100.json for the format, or run gridshard plan --calibrate.") from None


def builtin_hardware() -> list:
    return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".json"))


def load_hardware(name_or_path) -> Hardware:
    """A packaged device (``h100``, ``h200``, ``a100``, ``cpu``), a profile file, or a
    :class:`Hardware` / dict as is."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if isinstance(name_or_path, dict):
        return hardware_from_dict(name_or_path)
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(HARDWARE_DIR, f"{str(name_or_path).lower()}.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--hardware {name_or_path!r} is neither a packaged device ({', '.join(builtin_hardware())}) "
                          f"nor a profile file. Fix: pick one of those, or write one with gridshard plan --calibrate "
                          f"--out PROFILE.json.")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"hardware file {path!r} is not valid JSON: {e}. Fix: regenerate it with "
                              f"gridshard plan --calibrate.") from None
    return hardware_from_dict(raw)


__all__ = ["Hardware", "LinkCost", "load_hardware", "hardware_from_dict", "builtin_hardware", "COLLECTIVES", "GIB"]
