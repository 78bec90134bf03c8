"""Which rows of a rank's tensor block each data rank owns under ZeRO (pure arithmetic).

A parameter's local block (the tensor-parallel shard a rank stores, shape ``[n0, *rest]``)
is split over the D data ranks along its first stored dim, as ``torch.chunk`` would:
every rank is given ``c = ceil(n0 / D)`` rows, the last ones fewer (or none), so data
rank r owns rows ``[min(r·c, n0), min((r+1)·c, n0))``. Its shard is therefore a
*rectangular box* of the local block (rows × all of ``rest``), and so of the canonical
tensor: a checkpoint can write it as one chunk, and another layout reads it by overlap.

Communication buffers use the padded size ``c·R`` per rank and parameter (``R = Π rest``)
so that every rank's segment has the same length (reduce-scatter and all-gather need
equal segments); padding elements are zero and never reach the optimizer.
"""
from __future__ import annotations

import math


def rows_per_rank(n0: int, data: int) -> int:
    """c = ceil(n0 / D): rows of a rank's padded segment."""
    return -(-n0 // data) if n0 else 0


def owned_rows(n0: int, data: int, rank: int) -> tuple:
    """(start, stop) of the rows data rank ``rank`` of ``data`` owns (module docstring)."""
    c = rows_per_rank(n0, data)
    start = min(rank * c, n0)
    return start, min(start + c, n0)


def shard_numel(shape, data: int, rank: int) -> int:
    """Elements of the shard of a block of ``shape`` owned by data rank ``rank``."""
    if len(shape) == 0:
        return 1 if rank == 0 else 0
    start, stop = owned_rows(shape[0], data, rank)
    return (stop - start) * math.prod(shape[1:])


def padded_numel(shape, data: int) -> int:
    """Elements of one rank's padded segment for a block of ``shape``: c·R."""
    if len(shape) == 0:
        return 1
    return rows_per_rank(shape[0], data) * math.prod(shape[1:])
