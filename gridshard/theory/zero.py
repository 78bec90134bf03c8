"""ZeRO over the data dimension: which rows each data rank owns, and bytes moved per step.

Row shards
----------
A parameter's local block (the tensor-parallel shard a rank stores, shape ``[n0, *rest]``)
is split over the D data ranks along its first stored dim, as ``torch.chunk`` would:
every rank is given ``c = ceil(n0 / D)`` rows, the last ones fewer (or none), so data
rank r owns rows ``[min(r·c, n0), min((r+1)·c, n0))``. Its shard is therefore a
*rectangular box* of the local block (rows × all of ``rest``), and so of the canonical
tensor: a checkpoint can write it as one chunk, and another layout reads it by overlap.

Communication buffers use the padded size ``c·R`` per rank and parameter (``R = Π rest``)
so that every rank's segment has the same length (reduce-scatter and all-gather need
equal segments); padding elements are zero and never reach the optimizer.

Communication
-------------
Notation (per rank, fp32, :mod:`gridshard.zero.data_parallel`): the rank's trainable
parameters are grouped into units u (one per decoder layer, one *root* unit with the
embedding, final norm and head); a parameter with a local block of n0 rows of R elements
contributes c·R elements to each of the D equal segments of its unit's flat buffer,
c = ceil(n0/D), so the buffer has

    S_u = D · Σ_{p∈u} c_p · R_p  elements  (= the unit's local elements, plus row padding).

**Per optimizer step, A micro-batches, L_r decoder-layer units on this rank** (payload bytes
as the ledger records them: the unscattered input of a reduce-scatter, the gathered output
of an all-gather; b = bytes per element):

* ZeRO-1 and ZeRO-2: every unit once — reduce-scatter of S_u·b (gradients, after the last
  micro-batch) and all-gather of S_u·b (the updated rows). On a ring each moves
  (D−1)/D·S_u·b, together 2(D−1)/D·S_u·b: the all-reduce of ZeRO-0 (whose payload is the
  unpadded Σ n elements), up to padding.
* ZeRO-3: per micro-batch, an all-gather of every decoder layer in forward and again in
  backward; the root unit once per step (it stays gathered from its first use to the
  step's reduction: the head is the first thing every backward needs and the embedding the
  first thing every forward needs); then one reduce-scatter per unit per step:

      all_gather  = (A · 2 · Σ_layers S_u + S_root) · b,   reduce_scatter = Σ_u S_u · b

  With one micro-batch that is 3 transfers of the model against ZeRO-1/2's 2: the +50%
  of the ZeRO paper (the root unit's backward gather saved).

Clipping adds one 8-byte all-reduce over data (the shards' sum of squares).

**Model state** per stage (what each rank holds, and ZeRO-3's transient gathered layer):
:func:`gridshard.theory.memory.model_state_bytes`.
"""
from __future__ import annotations

import math

from . import CommVolume


def zero_step_comm(layer_units: list, root_unit: int, data: int, stage: int, micro_batches: int = 1,
                   bytes_per_elem: int = 4) -> CommVolume:
    """One step's ZeRO collectives over the data axis (module docstring). ``layer_units``: S_u
    of each decoder-layer unit on this rank; ``root_unit``: S_root (0 if none)."""
    vol = CommVolume(data)
    units = list(layer_units) + ([root_unit] if root_unit else [])
    if stage in (1, 2):
        for s in units:
            vol.add("reduce_scatter", s * bytes_per_elem)
            vol.add("all_gather", s * bytes_per_elem)
    elif stage == 3:
        for s in units:
            vol.add("reduce_scatter", s * bytes_per_elem)
        for s in layer_units:
            vol.add("all_gather", s * bytes_per_elem, calls=2 * micro_batches)
        if root_unit:
            vol.add("all_gather", root_unit * bytes_per_elem)
    else:
        raise ValueError(f"zero_step_comm: stage {stage} is not 1, 2 or 3 (ZeRO-0: training.dp_gradient_allreduce)")
    return vol


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
