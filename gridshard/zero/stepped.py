"""What the optimizer steps, the norm sums and the checkpoint writes, per parameter: one record,
:class:`SteppedTensor` — the parameter's name, the parameter, the tensor stepped and, for a ZeRO
shard, the local elements ``[a, b)`` of the parameter's flattened block it is
(:mod:`gridshard.theory.zero`). :func:`whole_parameters` is every parameter as itself (no reducer,
or ZeRO-0).

A leaf of :mod:`gridshard.zero`: the units build these records (:mod:`.units`), the reducer hands
them out (:mod:`.data_parallel`, :mod:`.reducer`), and nothing here imports either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from ..theory.zero import flat_range_boxes

__all__ = ["SteppedTensor", "whole_parameters"]


@dataclass(frozen=True)
class SteppedTensor:
    """What the optimizer steps for parameter ``name``: ``param`` itself (``elements`` None) or,
    for a ZeRO shard, the local elements ``[a, b)`` of the parameter's flattened block
    (``tensor`` 1-dim, b − a elements: a view into this rank's chunk of the unit's buffer)."""

    name: str
    param: nn.Parameter
    tensor: torch.Tensor
    elements: Optional[tuple] = None

    def pieces(self, tensor: Optional[torch.Tensor] = None) -> list:
        """(local box or None, the part of ``tensor`` — this one, or its AdamW moment — in it):
        the whole block once, or the boxes of the element range
        (:func:`gridshard.theory.zero.flat_range_boxes`: ≤ 3 for a matrix), each a view in the box's
        shape. Each box is the parameter's layout narrowed once more
        (:meth:`gridshard.nn.sharding.ShardSpec.canonical_box`)."""
        t = self.tensor if tensor is None else tensor
        if self.elements is None:
            return [(None, t)]
        a = self.elements[0]
        return [(box, t[lo - a:hi - a].view(tuple(h - l for l, h in box)))
                for box, (lo, hi) in flat_range_boxes(self.param.shape, *self.elements)]


def whole_parameters(model: nn.Module) -> Iterator[SteppedTensor]:
    """Every parameter of ``model`` as itself (the checkpoint's blocks without a reducer)."""
    for name, p in model.named_parameters():
        yield SteppedTensor(name, p, p)
