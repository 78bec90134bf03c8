"""Outputs computed ahead of a layer's call, for layers that share one input.

:mod:`gridshard.parallel.shared_input` computes the q|k|v (or gate|up) projections of one
input in a single matmul and leaves each layer its slice in the layer's
:class:`PrecomputedOutput` (``layer.precomputed``, made by the layer's constructor); the
layer's ``forward`` returns it when called with that very input tensor (identity, not
equality), and computes normally otherwise. A layer used on its own never has anything left
for it.
"""
from __future__ import annotations

from typing import Optional

import torch


class PrecomputedOutput:
    """At most one (input, output) pair left for a layer's next call, taken once."""

    __slots__ = ("_left",)

    def __init__(self):
        self._left = None

    def leave(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` is the layer's output for input ``x`` (replaces anything left before)."""
        self._left = (x, y)

    def take(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output left for input ``x``, once; ``None`` if there is none for this input."""
        left, self._left = self._left, None
        if left is not None and left[0] is x:
            return left[1]
        return None
