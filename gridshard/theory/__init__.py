"""Closed-form formulas: communication, parameter and activation bytes per rank.

Each tensor mode has its own module (``tp1d``, ``tp2d``, ...). Every function is
pure arithmetic (no process groups, no tensors), carries its derivation in the
docstring, and is asserted against the communication ledger or a measurement in
the tests. The planner estimates memory and step time from these same functions,
so a formula that the tests prove is the formula the planner uses.

Conventions shared by all modules:

* sizes are per *tensor-parallel group* unless a name says otherwise; ``T`` is the
  tensor-parallel size;
* ``bytes_per_elem`` is the element size of the tensor moved or stored (4 for fp32);
* communication volumes are *payload* bytes as the ledger counts them
  (:mod:`gridshard.comm.ledger`: the full tensor for all-reduce, the gathered output
  for all-gather, the unscattered input for reduce-scatter), returned per op as a
  :class:`CommVolume`; ``wire_bytes`` converts them to ring bytes sent per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.ledger import ring_wire_bytes


@dataclass
class CommVolume:
    """Calls and payload bytes per collective op, as one rank's ledger would record them.

    ``calls[op]`` and ``payload[op]`` for op in all_reduce / all_gather / reduce_scatter /
    broadcast. ``group_size`` is the size of the group all of them run on.
    """

    group_size: int
    calls: dict = field(default_factory=dict)
    payload: dict = field(default_factory=dict)

    def add(self, op: str, payload_bytes: int, calls: int = 1) -> "CommVolume":
        """Record ``calls`` collectives of ``op`` moving ``payload_bytes`` each (none if T = 1)."""
        if self.group_size > 1 and calls:
            self.calls[op] = self.calls.get(op, 0) + calls
            self.payload[op] = self.payload.get(op, 0) + calls * int(payload_bytes)
        return self

    def __add__(self, other: "CommVolume") -> "CommVolume":
        assert self.group_size == other.group_size, "adding volumes of different group sizes"
        out = CommVolume(self.group_size, dict(self.calls), dict(self.payload))
        for op in other.calls:
            out.calls[op] = out.calls.get(op, 0) + other.calls[op]
            out.payload[op] = out.payload.get(op, 0) + other.payload[op]
        return out

    def count(self, op: str) -> int:
        return self.calls.get(op, 0)

    def payload_bytes(self, op: str | None = None) -> int:
        return sum(self.payload.values()) if op is None else self.payload.get(op, 0)

    def wire_bytes(self) -> float:
        """Bytes one rank sends on bandwidth-optimal rings (see ``ring_wire_bytes``)."""
        return sum(ring_wire_bytes(op, b, self.group_size) for op, b in self.payload.items())


def combine_axes(*vols: dict) -> dict:
    """Sum volumes kept per mesh axis (``{axis name: CommVolume}``, as the 2.5D and 3D theories
    keep them: each axis has its own group size); every volume names the same axes."""
    out = {a: CommVolume(v.group_size) for a, v in vols[0].items()}
    for v in vols:
        for a in out:
            out[a] = out[a] + v[a]
    return out


def axes_rounds(vol: dict) -> int:
    """Collective calls per rank of a per-axis volume."""
    return sum(sum(v.calls.values()) for v in vol.values())


def axes_wire_bytes(vol: dict) -> float:
    """Ring bytes one rank sends for a per-axis volume, every axis with its own group size."""
    return sum(v.wire_bytes() for v in vol.values())


__all__ = ["CommVolume", "combine_axes", "axes_rounds", "axes_wire_bytes"]
