"""Memory per rank, §1: model state (parameters, gradients, optimizer state) by ZeRO stage.

Notation: see :mod:`gridshard.theory.memory`.

1. Model state (:func:`model_state_bytes`)
==========================================
Per parameter, n = numel of the rank's local tensor-parallel block (tied weights once; a
pipeline rank holds only its stages' parameters). ZeRO lays each *unit* u (a decoder layer,
or the root: embedding, final norm, head) out in one flat buffer of L_u = D·ceil(n_u/D)
elements, n_u = Σ_{p∈u} n (:mod:`gridshard.theory.zero`), and data rank r owns the chunk
C_u = L_u/D of it, s_u = ``unit_shard_numel`` of which are parameter elements (not padding).
What a rank holds after ``optimizer.step`` and before ``zero_grad``. fp32 and fp16 runs (fp16:
fp32 parameters, autocast and loss scaling) keep everything fp32, 16 bytes per parameter::

    stage   params      grads             optimizer (exp_avg + exp_avg_sq)   comm buffers
    0       4n          4n                8n                                  —
    1       4·ΣL_u      4·ΣL_u (buffer)   8·Σs_u                              4·ΣC_u  (the reduced chunk)
    2       4·ΣL_u      4·ΣC_u (chunk)    8·Σs_u                              —
    3       4·ΣC_u      4·ΣC_u            8·Σs_u                              —   (+ transient below)

bf16 runs (``param_bytes`` = 2: parameters and their gradient buffers in bf16, fp32 master
weights owned by the reducer, :mod:`gridshard.zero`) — the ZeRO paper's 16Ψ / 2Ψ+2Ψ+12Ψ/D /
2Ψ+14Ψ/D / 16Ψ/D, except that our reduced gradient chunk (the sharded accumulator) is fp32:
+4Ψ/D at ZeRO-1, +2Ψ/D at ZeRO-2; ZeRO-3 is the paper's 16Ψ/D: its parameter chunk is the fp32
master itself (no bf16 chunk; each gather casts it into the bf16 buffer and all-gathers bf16, as
FSDP2's sharded fp32 parameters with ``param_dtype`` bf16), which pays for the fp32 gradient chunk
(``tests/test_bf16_storage.py``)::

    stage   params (bf16 + fp32 master)   grads                    optimizer   comm buffers
    0       2n + 4n                       2n (bf16 buffer)         8n          —   (+ 2n step transient: the
                                                                                    fp32 master gradient, sync → step,
                                                                                    less the bf16 buffer it replaces;
                                                                                    A > 1: + 4n from the first
                                                                                    micro-batch, below)
    1       2·ΣL_u + 4·ΣC_u               2·ΣL_u (bf16 buffer)     8·Σs_u      4·ΣC_u (fp32 reduced chunk)
    2       2·ΣL_u + 4·ΣC_u               4·ΣC_u (fp32 chunk)      8·Σs_u      —
    3       4·ΣC_u (the fp32 master)      4·ΣC_u (fp32 chunk)      8·Σs_u      —   (+ transient below, 2-byte)

Per parameter at ZeRO-0: 2 + 2 + 4 + 8 = 16 bytes (Ψ = n); ZeRO-1: 2 + 2 + (4 + 8 + 4)/D;
ZeRO-2: 2 + (4 + 8 + 4)/D; ZeRO-3: (4 + 8 + 4)/D = 16/D — the fp32 reduced chunk (4/D) is the
fp32 main-grad of Megatron's distributed optimizer, sharded.

(ZeRO ≥ 1: the parameters are views into the units' buffers, padding included; the
gradient buffer of ZeRO-2/3 is freed once reduced.) Plus AdamW's ``step`` counter, a 0-dim
fp32 tensor per tensor it steps (4 bytes each; ZeRO ≥ 1: per parameter with an element in
this rank's chunk, the parameters taken in unit order as the blocks list them). With D = 1,
L_u = C_u = s_u = n_u and every stage equals stage 0 up to the stage-1 buffer.

ZeRO-0's gradients are views into its persistent buffer at D > 1, autograd's ``.grad`` at
D = 1; where one is a view into a larger buffer the whole buffer stays alive. In our layers
that happens once: 1D with more tensor ranks than kv heads (T > K), where the k/v gradient
is a view of the all-reduced buffer of all K blocks and the q|k|v gradient matmul keeps the
unused k, v rows behind q's view: K·(n_k + n_v) extra gradient elements per layer
(``ParamBlock.grad_extra``). ZeRO ≥ 1 accumulates every gradient into its unit's buffer, so
no such extra stays.

ZeRO-3 *transient* (4 → ``param_bytes`` under bf16): a unit is gathered straight into its
parameter buffer (L_u elements,
the parameters are views of it, no separate gather output); in forward and backward a decoder
layer is gathered while the next one's gather is in flight (prefetch: two consecutive layers
ℓ, ℓ' at once), and the *root* unit stays gathered from forward to the end of backward::

    transient = 4·L_root + 4·max over consecutive layers (L_ℓ + L_ℓ')     (one layer: 4·L_ℓ)

ZeRO-2/3 *backward gradients* (:func:`zero_gradient_transient`): a unit's gradient buffer
(4·L_u) is allocated when its backward starts and freed when its reduce-scatter is done; with
one backward at most 2 reduce-scatters are outstanding and one layer is being filled, and
the root's buffer lives from the head's gradient (the first) to the embedding's (the last).
With A > 1 micro-batches and sharded accumulation (:func:`gridshard.theory.zero.sharded_accumulation`:
overlap on, D > 1, P = 1 or any pipeline schedule but zero_bubble; every micro-batch is
reduce-scattered into the reduced chunk, which is the held 4·ΣC_u) that holds for every
micro-batch; without it every buffer lives from the first backward to the last
(accumulation without communication)::

    A = 1 or sharded:  4·(L_root + L_(1) + L_(2) + L_(3))  (three largest layers)
    otherwise:         4·Σ_u L_u

Under bf16 the buffers are 2-byte. With ``grad_reduce_dtype`` fp32 a unit's reduce-scatter
sends its fp32 cast (4·L_u), made once the oldest of 2 outstanding reductions is done, so at most
2 casts are alive; at ZeRO-2/3 the bf16 buffer is freed right after its cast (FSDP2 does the same).
A cast unit x (bf16 + cast, 6·L_x) beside one outstanding cast y (4·L_y), while the root's bf16
buffer (2·L_root, live from the head's gradient to the embedding's) fills, is the peak::

    bf16, fp32 reduce, ZeRO-2/3:  max(6·L_(1) + 4·L_(2) + 2·L_root, 6·L_(1) + 4·L_root, 6·L_root + 4·L_(1))

(10·L for equal layers away from the root, against 18·L when every bf16 buffer lived to the end
of its reduction with 3 casts: exact on one stage, an upper bound where the root fills late, the
first pipeline stage). ZeRO-1 keeps its whole gradients, so the casts alone: + 4·(U_(1) + U_(2)),
the two largest units, the root among them. With bf16 reduce the buffer itself is sent, as in
fp32 (2·(L_root + L_(1) + L_(2) + L_(3))), plus a 2-byte output chunk per outstanding reduction:
+ 2·(U_(1) + U_(2))/D (an upper bound, not asserted).

bf16 ZeRO-0/1 with A > 1 micro-batches (P = 1, D > 1, overlap: :func:`zero_accumulator_bytes`)
sum the micro-batches in an fp32 *accumulator* (Megatron's fp32 main gradient, unsharded), alive
from the first micro-batch's backward to the reduction: + 4n at ZeRO-0 (its fp32 reduced buffer,
early: 20 bytes per parameter during the backward, the step's 18 within it), + 4·ΣL_u at ZeRO-1
(reduce-scattered itself under an fp32 reduce, so no separate cast; with a bf16 reduce + the
2-byte output chunks above). With A = 1 nothing is added.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ...job_layout import TensorMode
from ..zero import chunk_range, unit_padded_numel, unit_shard_numel

FP32 = 4
ADAM_STATES = 2                     # exp_avg, exp_avg_sq
REDUCTIONS_IN_FLIGHT = 2            # ZeRO ≥ 1 reductions outstanding at once: gridshard.zero.settings.MAX_IN_FLIGHT
STEP_COUNTER_BYTES = 4              # AdamW's 0-dim fp32 ``step`` per parameter
INDEX_BYTES = 8                     # int64 token ids / targets
MASK_BYTES = 1                      # torch.bool


# ---------------------------------------------------------------------------------------
# parameter blocks of a rank
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamBlock:
    """One parameter's local tensor-parallel block on a rank: its shape and the decoder
    layer it belongs to (``layer=None``: a root parameter — embedding, final norm, head)."""

    name: str
    shape: tuple
    layer: Optional[int] = None
    #: elements of gradient storage this parameter's ``.grad`` keeps alive beyond its own
    #: (a view into a larger buffer; :func:`kv_replica_grad_extra`, replicated kv heads)
    grad_extra: int = 0
    #: an MoE layer's experts split over the E expert ranks: ZeRO shards them over the R/E
    #: expert-data ranks, in a unit of their own (:mod:`gridshard.zero.units`)
    expert: bool = False

    @functools.cached_property
    def numel(self) -> int:
        """∏ shape, computed once (the planner asks it millions of times per plan)."""
        return math.prod(self.shape)

    @property
    def in_decoder_layer(self) -> bool:
        return self.layer is not None


def _as_blocks(blocks) -> list:
    """Accept ParamBlocks or (shape, layer_or_None) pairs (``layer=True`` = some layer)."""
    out = []
    for i, b in enumerate(blocks):
        if isinstance(b, ParamBlock):
            out.append(b)
        else:
            shape, layer = b
            out.append(ParamBlock(f"p{i}", tuple(shape), 0 if layer is True else (None if layer is False else layer)))
    return out


def kv_replica_grad_extra(cfg, mode, T: int) -> dict:
    """Gradient elements each decoder-layer parameter keeps alive beyond its own block (module
    docstring §1), by its name within the layer: non-zero only in 1D with kv heads replicated
    over T/K ranks (K < T). ``sum_over_replicas`` all-reduces a buffer of all K blocks and hands
    back a view of it as the gradient (K·n elements kept for n), and the q|k|v weight gradient
    (one matmul, split into views) keeps q's view alive together with the now unused k and v
    rows: K·(n_k + n_v) elements per layer beyond the blocks."""
    mode = TensorMode.parse(mode)
    K = cfg.kv_heads
    if mode.kv_replication(K, T) <= 1:
        return {}
    n_kv = mode.local_kv_heads(K, T) * cfg.head_dim * cfg.hidden
    return {"self_attn.q_proj.weight": 2 * n_kv, "self_attn.k_proj.weight": (K - 1) * n_kv,
            "self_attn.v_proj.weight": (K - 1) * n_kv}


# ---------------------------------------------------------------------------------------
# model state
# ---------------------------------------------------------------------------------------
@dataclass
class ModelState:
    """Bytes one rank holds for parameters, gradients and optimizer state (module docstring §1).
    ``comm_buffers``: persistent ZeRO-1 reduce-scatter output; ``transient``: ZeRO-3's
    gathered parameters during forward/backward (not held at the end of a step);
    ``step_transient``: what exists only from the reduction to the end of the optimizer step,
    after the backward freed the activations (bf16 ZeRO-0's fp32 master gradient)."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int = 0
    transient: int = 0
    step_transient: int = 0

    @property
    def held(self) -> int:
        """What stays allocated between steps: params + grads + optimizer + comm buffers."""
        return self.params + self.grads + self.optimizer + self.comm_buffers

    @property
    def peak(self) -> int:
        return self.held + max(self.transient, self.step_transient)


def zero_units(blocks: Sequence) -> dict:
    """ZeRO's units of ``blocks`` (ParamBlocks or pairs, :func:`_as_blocks`): decoder layer (or
    ``"root"``; an MoE layer's split experts ``(layer, "experts")``) → its blocks in the order given
    (:mod:`gridshard.zero.data_parallel`)."""
    units: dict = {}
    for b in _as_blocks(blocks):
        key = b.layer if b.in_decoder_layer else "root"
        units.setdefault((key, "experts") if b.expert else key, []).append(b)
    return units


def unit_parts(unit, data: int, data_rank: int, expert: int = 1) -> tuple:
    """(parts, part) a ZeRO unit is sharded into and this rank's: the D data ranks, or for split
    experts (``(layer, "experts")``) the D/E expert-data ranks, member ``data_rank // E``
    (:mod:`gridshard.mesh_expert`)."""
    return (data // expert, data_rank // expert) if isinstance(unit, tuple) else (data, data_rank)


def _stepped_in_chunk(bs: list, data: int, data_rank: int) -> int:
    """Parameters of a unit (blocks in unit order) with an element in data rank ``data_rank``'s chunk."""
    lo, hi = chunk_range(unit_padded_numel([b.numel for b in bs], data), data, data_rank)
    count, off = 0, 0
    for b in bs:
        count += b.numel > 0 and off < hi and off + b.numel > lo
        off += b.numel
    return count


def param_element_bytes(precision: str) -> int:
    """Bytes of a stored parameter (and gradient) element under ``train.precision``: 2 under bf16
    (bf16 storage, fp32 masters), 4 under fp32 and fp16 (fp16 keeps fp32 parameters)."""
    return 2 if precision == "bf16" else FP32


def model_state_bytes(blocks: Sequence, zero: int = 0, data: int = 1, data_rank: int = 0,
                      step_counters: bool = True, param_bytes: int = FP32, expert: int = 1) -> ModelState:
    """Model-state bytes of one rank for its parameter blocks (module docstring §1).

    ``blocks``: :class:`ParamBlock` s or (local shape, decoder layer or None) pairs, each unit's
    in its parameter order; ``zero`` ∈ {0, 1, 2, 3}; ``data`` = D; ``data_rank`` which chunk this
    rank owns; ``step_counters`` counts AdamW's 4-byte ``step`` tensor per stepped parameter;
    ``param_bytes``: 4 (fp32 storage) or 2 (bf16 storage with fp32 masters, :func:`param_element_bytes`);
    ``expert``: E, the expert ranks an MoE model's experts are split over (their units are sharded
    over D/E ranks, :func:`unit_parts`: every sum below is over units of their own parts).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    blocks = _as_blocks(blocks)
    n, p = sum(b.numel for b in blocks), param_bytes
    mixed = p < FP32
    if zero == 0:
        counters = STEP_COUNTER_BYTES * sum(1 for b in blocks if b.numel) if step_counters else 0
        if mixed:      # the persistent bf16 buffer holds every gradient: no autograd buffer stays behind
            return ModelState(p * n + FP32 * n, p * n, ADAM_STATES * FP32 * n + counters, step_transient=(FP32 - p) * n)
        return ModelState(FP32 * n, FP32 * sum(b.numel + b.grad_extra for b in blocks),
                          ADAM_STATES * FP32 * n + counters)
    units = zero_units(blocks)
    parts = {u: unit_parts(u, data, data_rank, expert) for u in units}
    L = {u: unit_padded_numel([b.numel for b in bs], parts[u][0]) for u, bs in units.items()}
    C = sum(L[u] // parts[u][0] for u in units)
    s = sum(unit_shard_numel([b.numel for b in bs], *parts[u]) for u, bs in units.items())
    counters = STEP_COUNTER_BYTES * sum(_stepped_in_chunk(bs, *parts[u]) for u, bs in units.items())
    opt = ADAM_STATES * FP32 * s + (counters if step_counters else 0)
    master = FP32 * C if mixed else 0
    if zero == 1:
        return ModelState(p * sum(L.values()) + master, p * sum(L.values()), opt, comm_buffers=FP32 * C)
    if zero == 2:
        return ModelState(p * sum(L.values()) + master, FP32 * C, opt)
    layers = [v for u, v in L.items() if u != "root"]
    pairs = [a + b for a, b in zip(layers, layers[1:])] or layers
    transient = p * L.get("root", 0) + p * max(pairs, default=0)
    # the parameter chunk: fp32, and under bf16 storage the master itself (gathers cast it to bf16)
    return ModelState(FP32 * C, FP32 * C, opt, transient=transient)


def _units_padded(blocks: Sequence, data: int, expert: int = 1) -> dict:
    """L_u of every ZeRO unit of ``blocks`` (module docstring §1; split experts: :func:`unit_parts`)."""
    return {u: unit_padded_numel([b.numel for b in bs], unit_parts(u, data, 0, expert)[0])
            for u, bs in zero_units(blocks).items()}


def zero_reduce_cast_bytes(blocks: Sequence, zero: int, data: int, param_bytes: int = FP32,
                           reduce_bytes: int = FP32, expert: int = 1) -> int:
    """What reducing the units in flight adds under bf16 storage at ZeRO ≥ 1 (module docstring
    §1): each one's fp32 cast, 4·(U_(1) + U_(2)) with ``reduce_bytes`` 4 — the two largest units,
    the root among them (at most ``MAX_IN_FLIGHT`` = 2 casts are alive: the oldest reduction is
    waited for before the next cast) — or its 2-byte output chunk, 2·(…)/D, with 2; 0 at ZeRO-0 or
    with fp32 storage."""
    if zero == 0 or param_bytes >= FP32:
        return 0
    in_flight = sum(sorted(_units_padded(blocks, data, expert).values(), reverse=True)[:REDUCTIONS_IN_FLIGHT])
    return FP32 * in_flight if reduce_bytes >= FP32 else param_bytes * in_flight // data


def zero_accumulator_bytes(blocks: Sequence, zero: int, data: int, micro_batches: int = 1,
                           overlap: bool = True, param_bytes: int = FP32, expert: int = 1) -> int:
    """bf16 storage at ZeRO-0/1 with ``micro_batches`` > 1 (P = 1, D > 1, ``overlap``): the fp32
    accumulator each earlier micro-batch's bf16 gradients are added into (module docstring §1),
    4 bytes per gradient element — ZeRO-0: 4n (its fp32 reduced buffer, allocated at the first
    micro-batch instead of the reduction), ZeRO-1: 4·ΣL_u (freed unit by unit once reduced);
    0 otherwise."""
    if zero > 1 or param_bytes >= FP32 or micro_batches <= 1 or data <= 1 or not overlap:
        return 0
    return FP32 * (sum(b.numel for b in _as_blocks(blocks)) if zero == 0 else sum(_units_padded(blocks, data, expert).values()))


def zero_gradient_transient(blocks: Sequence, zero: int, data: int, micro_batches: int = 1,
                            sharded_accumulation: bool = True, param_bytes: int = FP32,
                            reduce_bytes: int = FP32, expert: int = 1) -> int:
    """Gradient buffers alive during a ZeRO-2/3 backward (module docstring §1); for ZeRO-0/1,
    whose full gradients are already in the held state, 0 — under bf16 storage (``param_bytes``
    2) plus, at ZeRO ≥ 1, what the reduction of the units in flight adds in ``reduce_bytes``,
    and with ``micro_batches`` > 1 at D > 1 the fp32 accumulator (:func:`zero_accumulator_bytes`).
    ``sharded_accumulation``: the reducer reduces inside the backward
    (:func:`gridshard.theory.zero.reduces_in_backward`): ZeRO-2/3 reduce-scatter every micro-batch;
    ZeRO-0/1 under bf16 accumulate in fp32."""
    accumulator = zero_accumulator_bytes(blocks, zero, data, micro_batches, sharded_accumulation, param_bytes,
                                         expert)
    if accumulator:                                    # ZeRO-1 fp32 reduce sends the accumulator itself: no cast
        return accumulator + (zero_reduce_cast_bytes(blocks, zero, data, param_bytes, reduce_bytes, expert)
                              if zero == 1 and reduce_bytes < FP32 else 0)
    if zero == 0:
        return 0
    L = _units_padded(blocks, data, expert)
    R = L.get("root", 0)
    l1, l2, l3 = (sorted((v for u, v in L.items() if u != "root"), reverse=True) + [0, 0, 0])[:3]
    cast = zero_reduce_cast_bytes(blocks, zero, data, param_bytes, reduce_bytes, expert)
    if zero < 2:
        return cast
    if micro_batches > 1 and not sharded_accumulation:
        return param_bytes * sum(L.values()) + cast
    if param_bytes < FP32 <= reduce_bytes:             # each bf16 buffer freed at its fp32 cast
        return max(6 * l1 + 4 * l2 + 2 * R, 6 * l1 + 4 * R, 6 * R + 4 * l1)
    return param_bytes * (R + l1 + l2 + l3) + cast
