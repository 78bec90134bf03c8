"""``none``: no tensor parallelism. T must be 1; every layer stays the plain module."""
from __future__ import annotations

from ...errors import LayoutError
from ...theory.memory import INDEX_BYTES
from ..base import Scheme


class ReplicatedScheme(Scheme):
    """Every weight whole on its one rank: no split, no tensor collective."""

    key, constant, summary = "none", "NONE", "no tensor parallelism"
    splits_weights = False

    def plannable(self, T: int) -> bool:
        return T == 1

    def check_unplanned(self, name: str, module) -> None:
        """Nothing is split, so a module the plan does not name stays as it is."""

    def embedding_saved_bytes(self, T: int, tokens: int) -> int:
        """Token ids only: the whole table needs no out-of-range mask."""
        return tokens * INDEX_BYTES

    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        self.check_no_depth(depth)
        if T != 1:
            raise LayoutError(f"tensor_mode='none' with tensor={T}: without tensor parallelism T must be 1. "
                              f"Fix: set tensor_mode to '1d' or '2d', or tensor=1.")
