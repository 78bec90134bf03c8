"""ZeRO over the data dimension: which elements each data rank owns, and bytes moved per step.

Element ranges (one flat layout per unit)
-----------------------------------------
Parameters are grouped into *units* (one per decoder layer, one *root* unit with the
embedding, final norm and head: :mod:`gridshard.zero.data_parallel`). A unit's parameters
are laid end to end in one flat buffer, parameter p (its local tensor-parallel block,
``numel`` n_p) at ``[off_p, off_p + n_p)``, off_p = Σ_{q<p} n_q, padded with zeros to a
multiple of D::

    n_u = Σ_p n_p,      L_u = D · ceil(n_u / D),      C_u = L_u / D

Data rank r owns the *element* range ``[r·C_u, (r+1)·C_u)`` of that buffer (Megatron-core's
distributed optimizer, FSDP1's flat parameter): a contiguous chunk, so the reduce-scatter of
the gradient buffer and the all-gather of the parameter buffer need no packing. Within
parameter p rank r owns the local elements ``[a, b)`` = ``[off_p, off_p + n_p) ∩ [r·C_u,
(r+1)·C_u)`` shifted by −off_p (:func:`owned_elements`; empty for most parameters of a large
unit). Rank r's elements of unit u that are not padding:

    s_u(r) = max(0, min(n_u, (r+1)·C_u) − r·C_u)

independent of the parameters' order. An element range of a ``[n0, *rest]`` block is a few
boxes of it — a partial first row, whole rows, a partial last row, recursively for more dims
(:func:`flat_range_boxes`) — and each box is a box of the canonical tensor
(:meth:`gridshard.nn.sharding.ShardSpec.canonical_box`): what checkpoints write, so they
reshard by overlap as before.

Communication
-------------
**Per optimizer step, A micro-batches** (payload bytes as the ledger records them: the
unscattered input of a reduce-scatter, the gathered output of an all-gather; b = bytes per
element), S_u = L_u:

* ZeRO-1 and ZeRO-2: every unit once — reduce-scatter of S_u·b (gradients, after the last
  micro-batch) and all-gather of S_u·b (the updated chunk). On a ring each moves
  (D−1)/D·S_u·b, together 2(D−1)/D·S_u·b: the all-reduce of ZeRO-0 (whose payload is the
  unpadded Σ n elements), up to < D padding elements per unit.
* ZeRO-2/3 with *sharded accumulation* (:func:`sharded_accumulation`: ``overlap``, D > 1,
  and P = 1 or a pipeline schedule whose backward accumulates through autograd, every schedule
  but ``zero_bubble``): the reduce-scatter of every unit runs after *each* micro-batch's
  backward, into the sharded accumulator (so no full gradient survives between
  micro-batches): A reduce-scatters per unit instead of one. Without it
  (``train.overlap_grad_reduce=false``, or ``zero_bubble``) the full gradients accumulate
  locally and are reduced once. One unit is the exception in a pipeline with tied embeddings:
  the root of a rank holding a copy of the tied weight (first and last stage) is reduced once,
  after the schedule, because the two copies' gradients are summed across stages first
  (:class:`gridshard.pipeline.tied.TiedEmbeddingSync`, on whole gradients: ``tied_root``).
* ZeRO-3: per micro-batch, an all-gather of every decoder layer in forward and again in
  backward; the root unit once per step (it stays gathered from its first use to the
  step's reduction: the head is the first thing every backward needs and the embedding the
  first thing every forward needs); then one reduce-scatter per unit per step:

      all_gather  = (A · 2 · Σ_layers S_u + S_root) · b,   reduce_scatter = Σ_u S_u · b

  With one micro-batch that is 3 transfers of the model against ZeRO-1/2's 2: the +50%
  of the ZeRO paper (the root unit's backward gather saved).

Clipping adds one 8-byte all-reduce over data (the shards' sum of squares).

Bytes per element: fp32 runs b = 4 for both. bf16 storage (``train.precision: bf16``): the
all-gathers move bf16 parameters, b_gather = 2 (ZeRO-3: each rank's fp32 master chunk, its
parameter chunk, cast to bf16 just before the gather); the reduce-scatters move
``train.grad_reduce_dtype``'s elements, b = 4 (fp32: each unit's bf16 gradient buffer cast to
fp32 first) or 2 (bf16).

**Model state** per stage (what each rank holds, and ZeRO-3's transient gathered layer):
:func:`gridshard.theory.memory.model_state_bytes`.
"""
from __future__ import annotations

import math

from . import CommVolume


# pipeline schedules whose backward runs through torch.autograd.backward, so the reducer's
# post-accumulate-grad hooks see every unit complete (sharded_accumulation's docstring)
SHARDED_ACCUMULATION_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def reduces_in_backward(zero: int, data_ranks: int, pipeline: int = 1, schedule: str = "1f1b",
                        overlap: bool = True) -> bool:
    """Whether the reducer issues reductions inside the backward (``ZeroDataParallel``'s
    ``overlap``): ``train.overlap_grad_reduce`` on, more than one data rank (``data_ranks`` = D·C),
    and either no pipeline (P = 1: ZeRO-0/1 in the armed last micro-batch, ZeRO-2/3 in every
    one) or ZeRO-2/3 under a schedule in :data:`SHARDED_ACCUMULATION_SCHEDULES`. A pipeline runs
    every micro-batch's backward inside the schedule, so ZeRO-0/1 cannot be armed for the last
    one and reduce after it (their tied-embedding copies are then summed on whole gradients)."""
    if not overlap or data_ranks <= 1:
        return False
    return pipeline == 1 or (zero >= 2 and schedule in SHARDED_ACCUMULATION_SCHEDULES)


def sharded_accumulation(zero: int, data_ranks: int, pipeline: int = 1, schedule: str = "1f1b",
                         overlap: bool = True) -> bool:
    """Whether ZeRO-2/3 reduce-scatter every micro-batch into the sharded fp32 accumulator
    (module docstring), the one home of the fact: the reducer's construction
    (``gridshard.engine.job._reducer``, through :func:`reduces_in_backward`), the memory model
    (:func:`gridshard.theory.memory.predict_rank_memory`) and the planner read it.

    ``zero_bubble`` is excluded: its deferred weight pass computes the weight gradients of
    every stage but the first with ``torch.autograd.grad`` and adds them to ``param.grad`` by
    hand (``torch.distributed.pipelining._backward.stage_backward_weight``), so no
    post-accumulate-grad hook fires and a unit's completion is never seen; it keeps whole
    gradients until ``sync()``. GPipe, 1F1B and interleaved 1F1B run each micro-batch's
    backward with ``torch.autograd.backward``: the hooks fire as at P = 1."""
    return zero >= 2 and reduces_in_backward(zero, data_ranks, pipeline, schedule, overlap)


def zero_step_comm(layer_units: list, root_unit: int, data: int, stage: int, micro_batches: int = 1,
                   bytes_per_elem: int = 4, sharded_accumulation: bool = False,
                   gather_bytes: int = None, tied_root: bool = False) -> CommVolume:
    """One step's ZeRO collectives over the data axis (module docstring). ``layer_units``: S_u
    of each decoder-layer unit on this rank; ``root_unit``: S_root (0 if none);
    ``sharded_accumulation``: ZeRO-2/3 reduce-scatter every micro-batch; ``tied_root``: the
    root holds a pipeline's tied-embedding copy, reduced once after the cross-stage sum;
    ``bytes_per_elem``: of the reduce-scatters; ``gather_bytes``: of the all-gathers (default
    ``bytes_per_elem``; 2 under bf16 storage)."""
    vol = CommVolume(data)
    g = bytes_per_elem if gather_bytes is None else gather_bytes
    units = list(layer_units) + ([root_unit] if root_unit else [])
    reductions = micro_batches if sharded_accumulation and stage >= 2 else 1
    calls = [reductions] * len(layer_units) + ([1 if tied_root else reductions] if root_unit else [])
    if stage in (1, 2):
        for s, n in zip(units, calls):
            vol.add("reduce_scatter", s * bytes_per_elem, calls=n)
            vol.add("all_gather", s * g)
    elif stage == 3:
        for s, n in zip(units, calls):
            vol.add("reduce_scatter", s * bytes_per_elem, calls=n)
        for s in layer_units:
            vol.add("all_gather", s * g, calls=2 * micro_batches)
        if root_unit:
            vol.add("all_gather", root_unit * g)
    else:
        raise ValueError(f"zero_step_comm: stage {stage} is not 1, 2 or 3 (ZeRO-0: training.dp_gradient_allreduce)")
    return vol


def unit_padded_numel(numels, data: int) -> int:
    """L_u = D · ceil(Σ n_p / D): a unit's flat buffer, padded so that D ranks get equal chunks."""
    n = sum(numels)
    return -(-n // data) * data


def chunk_range(padded: int, data: int, rank: int) -> tuple:
    """``[r·C, (r+1)·C)``, C = L/D: the elements of a unit's buffer of ``padded`` = L elements
    that data rank ``rank`` owns."""
    c = padded // data
    return rank * c, (rank + 1) * c


def owned_elements(offset: int, numel: int, chunk: tuple) -> tuple:
    """(a, b): the local elements ``[a, b)`` of a parameter at ``[offset, offset + numel)`` of its
    unit's buffer that fall in ``chunk`` = (lo, hi); a == b when none do."""
    lo, hi = chunk
    a = min(max(lo - offset, 0), numel)
    b = max(min(hi - offset, numel), a)
    return a, b


def unit_shard_numel(numels, data: int, rank: int) -> int:
    """s_u(r): elements of data rank ``rank``'s chunk of a unit that are not padding."""
    n = sum(numels)
    lo, hi = chunk_range(unit_padded_numel(numels, data), data, rank)
    return max(0, min(n, hi) - lo)


def flat_range_boxes(shape, start: int, stop: int) -> list:
    """The elements ``[start, stop)`` of a row-major block of ``shape`` as boxes: a list of
    ``(box, (a, b))`` in order, ``box`` = ((lo, hi) per dim) and ``[a, b)`` the flat elements it
    is (contiguous, so the box is ``flat[a:b].view(hi − lo per dim)``). Along dim 0: a partial
    first row (the same decomposition of the row, recursively), the whole rows, a partial last
    row — at most 2·ndim − 1 boxes, exactly the range, each element once."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if not shape:
        return [((), (start, stop))]
    inner = math.prod(shape[1:])
    rest = tuple((0, n) for n in shape[1:])
    first, col0 = divmod(start, inner)
    last, col1 = divmod(stop, inner)
    out = []
    if col0:                                                    # partial first row
        end = min(stop, (first + 1) * inner)
        base = first * inner
        out += [(((first, first + 1),) + box, (a + base, b + base))
                for box, (a, b) in flat_range_boxes(shape[1:], col0, end - base)]
        first, start = first + 1, end
        if start >= stop:
            return out
    if last > first:                                            # whole rows
        out.append((((first, last),) + rest, (first * inner, last * inner)))
    if col1:                                                    # partial last row
        base = last * inner
        out += [(((last, last + 1),) + box, (a + base, b + base))
                for box, (a, b) in flat_range_boxes(shape[1:], 0, col1)]
    return out
