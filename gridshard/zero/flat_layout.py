"""The flat layout every reducer lays parameters (and their gradients) out in.

A group of parameters — ZeRO-0's parameters of one dtype and device, or one ZeRO unit (a
decoder layer, the root) — is laid end to end in one flat buffer, parameter i at
``[offsets[i], offsets[i] + numels[i])``, the end padded with zeros to a multiple of ``parts``
(D for ZeRO ≥ 1, whose data ranks own equal chunks; 1 for ZeRO-0)::

    buffer [ p0 | p1 | p2 | pad ]        view_i = buffer[off_i : off_i + n_i].view(shape_i)
    chunks [  rank 0  |  rank 1  ]       rank r: [r·L/D, (r+1)·L/D)  (gridshard.theory.zero)

``.grad`` (every stage) and, at ZeRO ≥ 1, the parameters themselves are views into such
buffers, set once: collectives act on the buffers or their chunks in place, nothing is packed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..theory.zero import chunk_range, owned_elements, unit_padded_numel


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of ``numels`` laid end to end, padded to ``padded`` (a multiple of ``parts``)."""

    numels: tuple
    offsets: tuple
    padded: int
    parts: int = 1

    @classmethod
    def of(cls, numels, parts: int = 1) -> "FlatLayout":
        offsets, at = [], 0
        for n in numels:
            offsets.append(at)
            at += n
        return cls(tuple(numels), tuple(offsets), unit_padded_numel(numels, parts), parts)

    def views(self, buffer: torch.Tensor, shapes) -> list:
        """Each parameter's slice of ``buffer`` viewed in its shape."""
        return [buffer[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, shapes)]

    def chunk(self, rank: int) -> tuple:
        """(lo, hi): the elements part ``rank`` of ``parts`` owns."""
        return chunk_range(self.padded, self.parts, rank)

    def owned(self, rank: int) -> list:
        """Per parameter, (a, b): its local elements in part ``rank``'s chunk (a == b: none)."""
        chunk = self.chunk(rank)
        return [owned_elements(o, n, chunk) for o, n in zip(self.offsets, self.numels)]
