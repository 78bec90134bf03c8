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
* bytes streamed through memory at ``memory_bandwidth`` (AdamW; the layers' element-wise
  traffic at ``elementwise_bandwidth`` when the file has it — ``--calibrate`` fits it to the
  real trainer at two token counts, since a norm, softmax or RoPE kernel streams far below a
  large copy's rate — else at ``memory_bandwidth``).

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
bus bandwidth of the op, not the raw link rate: the GPU files take it from published nccl-tests
figures, below; a calibrated profile measures it).

Bus bandwidth
-------------
The packaged GPU profiles take ``bandwidth`` from published nccl-tests figures (each file's
``sources``). nccl-tests (``doc/PERFORMANCE.md``) reports for a collective of S bytes on n ranks
taking t seconds the *algorithm* bandwidth ``algbw = S / t`` and the *bus* bandwidth
``busbw = algbw · 2(n − 1)/n`` (all-reduce) or ``algbw · (n − 1)/n`` (all-gather, reduce-scatter;
S the whole gathered / reduced buffer), the rate of the slowest link of a ring, the same for every
n. The ring wire bytes above are exactly ``W = S · 2(n − 1)/n`` (all-reduce) and
``S · (n − 1)/n`` (all-gather, reduce-scatter), so ``W / bandwidth = S / algbw`` when
``bandwidth = busbw``: the file's ``bandwidth`` *is* the published bus bandwidth, with no
further derating (a send's: its algorithm bandwidth, S / t).

Across nodes the bus bandwidth of a group depends on how many of its members share a node: a ring
through k members of each node uses their k NICs at once, so ``links.inter.<op>`` may carry
``"bandwidth_by_ranks_per_node": {"8": B/s, ...}`` — the published bus bandwidth with k members
per node (e.g. 8 GPUs of each DGX A100, 8 HDR NICs: 192 GB/s), ``bandwidth`` being the one-member
figure (one NIC); between the points it is interpolated linearly in k and clamped at the largest k
(:meth:`LinkCost.bus_bandwidth`). The planner passes k for a 1D tensor group (its T consecutive
ranks: min(T, ranks per node)) and for the data × context group (:func:`.price_links.group_ranks_per_node`);
pipeline and context sends are point-to-point, one NIC each (k = 1), as are the rest.

Over-subscribed nodes
---------------------
When more ranks share a node than it has compute slots (CPU ranks on a few cores: r > slots), the
node is *throughput-bound*: a rank that waits in a collective or a pipeline bubble leaves its
core to another rank, so the step lasts about as long as all the node's busy CPU time shared
over its slots (measured here at 4 and 8 ranks on 2 cores: Σ over ranks of process CPU
seconds per step / wall seconds = 1.65–1.9 and 2.0). A collective then costs what it keeps a
core busy: per rank ``cpu_latency_s + cpu_latency_per_rank_s·(n − 2) + W / cpu_bandwidth``
CPU seconds (``LinkCost.cpu_seconds``; ``--calibrate`` measures them with the process CPU
clock around the same calls it times, gloo's own threads included; a file without them falls
back to the α–β wall time). How the planner combines the two bounds: cost_time.

``tensor_call_overhead_s`` (``{"1d": s, "2d": s}``, default 0): CPU seconds of work around each
tensor-parallel collective that the terms above do not price — the autograd node, Python
dispatch and the copies of gridshard's layers — measured by ``--calibrate`` on the real trainer
(calibrate module docstring); on GPUs the host runs ahead of the device, left 0.

``p2p_call_overhead_s`` (default 0): seconds of pipeline-schedule work per stage send or receive
(per micro-batch and boundary), fitted by ``--calibrate`` to a two-stage trainer likewise.

``sync_skew_s`` (default 0): the extra wait of one *synchronous* collective inside a training
step over its isolated α–β cost — the ranks reach it at different times. On a GPU node (a device
per rank) this is small and left 0; on an over-subscribed CPU (more ranks than cores) a rank
that arrives waits for its peers to be scheduled and finish their share of the compute
before it, about a scheduler time slice per call. ``gridshard plan --calibrate`` measures it
(calibrate module docstring); the planner adds it once per exposed call (price_links).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

from ..errors import ConfigError

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")
GIB = 1 << 30


@dataclass
class LinkCost:
    """α–β cost of one collective kind on one link level."""

    bandwidth: float          # achieved bytes/s per rank (wire bytes)
    latency_s: float          # per call, on 2 ranks
    latency_per_rank_s: float = 0.0
    cpu_bandwidth: Optional[float] = None          # wire bytes per CPU second of one rank
    cpu_latency_s: Optional[float] = None          # CPU seconds of one rank per call, on 2 ranks
    cpu_latency_per_rank_s: float = 0.0
    bandwidth_by_ranks_per_node: dict = field(default_factory=dict)   # k members per node -> bus bandwidth

    def bus_bandwidth(self, ranks_per_node: int = 1) -> float:
        """Bus bandwidth of a group with ``ranks_per_node`` members in each node (module docstring,
        "Bus bandwidth"): ``bandwidth`` at 1, the file's ``bandwidth_by_ranks_per_node`` points
        above, linear in k between them, clamped at the largest k."""
        if ranks_per_node <= 1 or not self.bandwidth_by_ranks_per_node:
            return self.bandwidth
        pts = [(1, self.bandwidth)] + sorted((int(k), float(b)) for k, b in self.bandwidth_by_ranks_per_node.items()
                                             if int(k) > 1)
        k = max(1, int(ranks_per_node))
        if k >= pts[-1][0]:
            return pts[-1][1]
        (k0, b0), (k1, b1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= k <= b[0])
        return b0 + (k - k0) / (k1 - k0) * (b1 - b0)

    def seconds(self, wire_bytes: float, calls: int = 1, group_size: int = 2, ranks_per_node: int = 1) -> float:
        if not calls:
            return 0.0
        latency = self.latency_s + self.latency_per_rank_s * max(0, group_size - 2)
        return calls * latency + wire_bytes / self.bus_bandwidth(ranks_per_node)

    def cpu_seconds(self, wire_bytes: float, calls: int = 1, group_size: int = 2, ranks_per_node: int = 1) -> float:
        """CPU seconds one rank spends in ``calls`` such calls moving ``wire_bytes`` in all
        (module docstring, over-subscribed nodes); the wall time when the CPU cost is unknown."""
        if self.cpu_latency_s is None or not self.cpu_bandwidth:
            return self.seconds(wire_bytes, calls, group_size, ranks_per_node)
        if not calls:
            return 0.0
        latency = self.cpu_latency_s + self.cpu_latency_per_rank_s * max(0, group_size - 2)
        return calls * latency + wire_bytes / self.cpu_bandwidth


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
    tensor_call_overhead_s: dict = field(default_factory=dict)   # tensor mode -> CPU seconds around each call
    elementwise_bandwidth: Optional[float] = None   # bytes/s of the layers' element-wise passes (else memory_bandwidth)
    p2p_call_overhead_s: float = 0.0       # seconds of schedule work per stage send or receive
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

    def oversubscribed(self, ranks_per_node: int) -> bool:
        """More ranks than compute slots on a node: the throughput-bound regime (module docstring)."""
        return self.contention(ranks_per_node) > 1.0

    # ---- communication -----------------------------------------------------------------
    def link(self, level: str, op: str) -> LinkCost:
        table = self.links.get(level) or self.links["intra"]
        return table.get(op) or table["default"]


def _from_fields(cls, raw: dict, given: dict):
    """``cls`` from ``raw``: the ``given`` fields as passed, every other one read by its name (one without a default
    is required: a KeyError) and cast to its annotated int or float (None stays None)."""
    values = dict(given)
    for f in fields(cls):
        if f.name not in values:
            v = raw[f.name] if f.default is MISSING else raw.get(f.name, f.default)
            values[f.name] = None if v is None else (int if f.type == "int" else float)(v)
    return cls(**values)


def _link_table(raw: dict) -> dict:
    out = {}
    for level, ops in raw.items():
        out[level] = {op: _from_fields(LinkCost, v, {"bandwidth_by_ranks_per_node": {
            int(k): float(b) for k, b in (v.get("bandwidth_by_ranks_per_node") or {}).items()}})
            for op, v in ops.items() if isinstance(v, dict)}
        if "default" not in out[level]:
            raise ConfigError(f"hardware links.{level} has no 'default' entry. Fix: add "
                              f"\"default\": {{\"bandwidth\": ..., \"latency_s\": ...}}.")
    if "intra" not in out:
        raise ConfigError("hardware file has no links.intra section. Fix: describe the link inside a node.")
    return out


def _peak_flops(raw: dict) -> dict:
    """``peak_flops`` as written (a calibrated profile's measured rates), or the datasheet table
    of the GPU named by ``peak_flops_of`` (:mod:`gridshard.peak_flops`, the table MFU reads too)."""
    if "peak_flops" in raw:
        return {k: float(v) for k, v in raw["peak_flops"].items()}
    from ..peak_flops import device_peaks

    peaks = device_peaks(raw["peak_flops_of"])
    if peaks is None:
        raise ConfigError(f"peak_flops_of={raw['peak_flops_of']!r} names no GPU of gridshard/peak_flops.py. Fix: "
                          f"an exact name from its DEVICE_PEAK_FLOPS, or a \"peak_flops\" table in the file.")
    return peaks


def hardware_from_dict(raw: dict) -> Hardware:
    try:
        return _from_fields(Hardware, raw, dict(
            name=raw["name"], peak_flops=_peak_flops(raw), links=_link_table(raw["links"]),
            gemm_efficiency=sorted([float(f), float(e)] for f, e in raw["gemm_efficiency"]),
            tensor_call_overhead_s={k: float(v) for k, v in (raw.get("tensor_call_overhead_s") or {}).items()},
            sources=list(raw.get("sources", [])), notes=raw.get("notes", "")))
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


__all__ = ["Hardware", "LinkCost", "load_hardware", "hardware_from_dict", "builtin_hardware", "GIB"]
