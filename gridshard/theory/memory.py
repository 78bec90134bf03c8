"""Memory per rank: model state by ZeRO stage, activations by tensor mode and recompute.

Arithmetic over shapes (no process groups, no tensors). The shapes of a rank's parameter
blocks are not described here: they are read from the layouts of the model laid out on the
meta device (:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`) and handed to
:func:`predict_rank_memory` by its caller (``theory`` imports no model code). The planner and the trainer's
``predicted_mem_bytes`` call these functions; ``tests/test_memory_model.py`` asserts them
against the tensors a real laid-out model holds.

Notation: h hidden, H heads, K kv heads, d = h/H, f MLP width, V vocabulary (V_p padded
to the tensor split), L layers, b micro-batch, s sequence, N = b·s tokens of a tensor
group's micro-batch, T tensor size (q = √T in 2D), D data size, P pipeline stages.

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
+4Ψ/D at ZeRO-1, +2Ψ/D at ZeRO-2/3 (``tests/test_bf16_storage.py``)::

    stage   params (bf16 + fp32 master)   grads                    optimizer   comm buffers
    0       2n + 4n                       2n (bf16 buffer)         8n          —   (+ 2n step transient: the
                                                                                    fp32 master gradient, sync → step,
                                                                                    less the bf16 buffer it replaces;
                                                                                    A > 1: + 4n from the first
                                                                                    micro-batch, below)
    1       2·ΣL_u + 4·ΣC_u               2·ΣL_u (bf16 buffer)     8·Σs_u      4·ΣC_u (fp32 reduced chunk)
    2       2·ΣL_u + 4·ΣC_u               4·ΣC_u (fp32 chunk)      8·Σs_u      —
    3       2·ΣC_u + 4·ΣC_u               4·ΣC_u (fp32 chunk)      8·Σs_u      —   (+ transient below, 2-byte)

Per parameter at ZeRO-0: 2 + 2 + 4 + 8 = 16 bytes (Ψ = n); ZeRO-1: 2 + 2 + (4 + 8 + 4)/D;
ZeRO-2: 2 + (4 + 8 + 4)/D; ZeRO-3: (2 + 4 + 8 + 4)/D — the fp32 reduced chunk (4/D) is the
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

Under bf16 the buffers are 2-byte; with ``grad_reduce_dtype`` fp32 each unit in flight also
holds its fp32 cast (4·L_u, the reduce-scatter's input) — bounded by the same units, at every
ZeRO ≥ 1 stage: + 4·(L_root + L_(1) + L_(2) + L_(3)); with bf16 reduce a 2-byte output chunk
per unit in flight: + 2·(L_root + L_(1) + L_(2) + L_(3))/D (an upper bound, not asserted).

bf16 ZeRO-0/1 with A > 1 micro-batches (P = 1, D > 1, overlap: :func:`zero_accumulator_bytes`)
sum the micro-batches in an fp32 *accumulator* (Megatron's fp32 main gradient, unsharded), alive
from the first micro-batch's backward to the reduction: + 4n at ZeRO-0 (its fp32 reduced buffer,
early: 20 bytes per parameter during the backward, the step's 18 within it), + 4·ΣL_u at ZeRO-1
(reduce-scattered itself under an fp32 reduce, so no separate cast; with a bf16 reduce + the
2-byte output chunks above). With A = 1 nothing is added.

2. Activations (:func:`activation_bytes`)
=========================================
The bytes autograd keeps for backward during one micro-batch's forward (counted once per
storage; parameters excluded), derived for gridshard's Llama block op by op as
Korthikanti et al. (2022) did for GPT. e = bytes of an activation element: 4 in fp32, 2 under
bf16/fp16 autocast, where gridshard's model keeps its activations in the compute dtype
(:mod:`gridshard.models.llama`, "Precision": the embedding output is cast, so the residual
stream, the norms' outputs, q/k/v, the MLP tensors and the RoPE tables are e-byte); what stays
fp32 is written with 4: the norms' rstd, the attention log-sum-exp, the loss's softmax, and
ids (8) and masks (1). Let the rank's token rows be
N_r = N (none, 1D) or N/q (2D: the batch is split over grid rows); the residual stream
per rank is R = N·h (none, 1D), N·h/T (1D+SP: the sequence is split), N·h/q² (2D);
H_r, K_r, f_r the rank's heads, kv heads and MLP width: (H, K, f) without tensor
parallelism, (H/T, K/min(T, K), f/T) in 1D (kv heads replicated in groups when T > K),
(H/q, K/q, f/q) in 2D.
3D (T = q³, issue 24; the layers of docs/tp3d.md): N_r = N/q² (batch block i·q + j of q²), R = N·h/q³,
(H/q, K/q, f/q), logits V_p/q with V_p = ⌈V/q⌉·q. Every Linear3D keeps only its input block
(N·in/q³, 1/T of one device's; the gathered X and W are gathered again in backward; V_p = ⌈V/q²⌉·q²
with a tied head, the embedding's padding), which is a
tensor the table below already counts (the norm output, the attention output, silu(g)·u); the norms
and the loss are 2D's functions on the cube's ``output`` axis (2D's rows below with q the cube side);
the embedding gathers the whole micro-batch's ids over ``batch`` (N·8 + the N·1 mask, as 2D's);
no weight copies (the matmul saves the parameter block and casts inside); under ``selective`` the
3D norms' outputs are rebuilt as 2D's are; a tied head keeps a copy of its weight slice of the gathered
table (:func:`gridshard.tensor.tp3d.scheme.tied_head_saved_bytes`). Asserted against the meter on all 8 ranks of a q = 2 cube,
every recompute mode, fp32 and bf16, tied and untied (``tests/test_planner_3d.py``, wide).

* **RMSNorm** (twice per layer). It keeps its input x (R·e) and the reciprocal rms (R/h·4, one
  per token); in fp32 also the normalised x̂ = x·rstd (R·4: ``F.rms_norm`` on CPU runs as pow,
  mean, rsqrt, mul, mul; a fused CUDA kernel may keep x and rstd only — not measured here),
  while a bf16/fp16 x goes through :func:`gridshard.nn.norm.rms_norm`'s own backward, which
  rebuilds x̂ (as a fused kernel does). The output y = x̂·w is kept by the
  projections that read it (R·e; under SP that is the sequence block, N·h/T·e: the column
  layers keep their block and all-gather it again in backward,
  :mod:`gridshard.tensor.tp1d.input_grad_overlap`, instead of keeping the gathered N·h·e). 2D
  (``RMSNorm2D``, one autograd function, fp32 arithmetic inside) keeps x (R·e), the rms
  (N_r·4), the gathered weight block (h/q·4) and, through the SUMMA product, y (R·e).
* **q|k|v** (one matmul on the shared input): keeps that input (counted above). Their
  outputs are kept by RoPE/attention below.
* **Attention core** (RoPE + ``scaled_dot_product_attention``, causal). RoPE's multiplies
  keep only the cos/sin tables ([s, d] each, e-byte: the model's cache,
  :class:`gridshard.models.rope.RopeTableCache`, one pair for every layer and micro-batch,
  so **held once per rank**, 2·s·d·e, not per micro-batch in flight). PyTorch's SDPA on these
  shapes is the flash kernel (measured on CPU; GPU flash / memory-efficient kernels keep the
  same set): it keeps rotated q (N_r·H_r·d·e), rotated k and v (N_r·K_r·d·e each), its output
  (N_r·H_r·d·e) and the log-sum-exp (N_r·H_r·4), *not* the s×s score matrix —
  Korthikanti's 5·a·s²·b term belongs to an unfused softmax (and dropout, which we lack).
* **o_proj** (row/2D): keeps its input, which is the attention output already counted
  (a view of the same storage).
* **MLP**: gate output g (for SiLU), silu(g) and up output u (for the product), and the
  product (down's input): 4·N_r·f_r·e.
* Residual additions keep nothing.

Per layer, recompute ``none``::

    2·norm + N_r·d·(2·H_r + 2·K_r)·e + N_r·H_r·4 + 4·N_r·f_r·e
    norm = R·e + R·4 + R/h·4 + R·e      fp32: x, x̂, rstd, y   (none, 1D, 1D + SP; y the block under SP)
         = R·e + R/h·4 + R·e            bf16/fp16: x, rstd, y
         = 2R·e + N_r·4 + h/q·4         2D, any precision

``selective`` (:mod:`gridshard.parallel.recompute`: the attention core and the MLP activation
are non-reentrant checkpoints, and the norm outputs and the product silu(g)·u are *rebuilt*,
:mod:`gridshard.nn.rebuild`): the core keeps its inputs — q, k, v before RoPE (same sizes as
after) and the shared cos/sin — instead of its activations, and its output stays kept by
o_proj; the MLP region keeps g and u; the consumers of the two norm outputs (q|k|v, gate|up)
and of the product (down) keep recipes over tensors kept anyway (x̂ and w, or x, rstd and w;
g and u), not the tensors. The layer saves the log-sum-exp N_r·H_r·4, silu(g) and the product
(2·N_r·f_r·e) and the two norm outputs (2·R·e) less::

    2·norm_r + N_r·d·(2·H_r + 2·K_r)·e + 2·N_r·f_r·e
    norm_r = norm − R·e            (x, x̂, rstd fp32; x, rstd bf16/fp16; 2D: x, the rms, the w block)

The final norm (before the head) is outside the decoder layers and keeps y in every mode.

``full``: each decoder layer keeps only its input, R·e (+ the shared cos/sin).

**Weight copies** (:func:`weight_copy_bytes`; bf16/fp16 with fp32 parameters only). Autocast
multiplies an fp32 weight through an e-byte copy, and autograd keeps the copy wherever the
matmul saves its weight operand: every projection and the head in mode none (``F.linear``) and
in 2D (SUMMA), only the row layers (o_proj, down_proj) in 1D, whose column layers save the
fp32 parameter itself and cast again in backward. Per decoder layer (not under ``full``:
the checkpointed forward's copies are dropped) e·(h·d·(2H+2K) + 3·h·f) (none; the local blocks
in 2D) or e·h·(H_r·d + f_r) (1D); the head e·h·V (none) or e·h/q·V_p/q (2D) on the last stage.
Autocast caches the copy for its region (a micro-batch's forward; the whole schedule of a
pipeline step), so they are **held once per rank**, not per micro-batch. They vanish when the
parameters are stored in the compute dtype (``param_bytes = e``). Not modelled: 1D without SP
with ``parallel.overlap_input_grad: false``, whose column layers go through ``F.linear`` and
keep copies too.

For comparison with Korthikanti et al.'s s·b·h·(34 + 5·a·s/h)/t bytes per GPT layer with TP
and SP (2-byte activations, 1-byte dropout masks): ours with K = H and f = 8h/3, in units of
s·b·h/t bytes (terms in 1/h and 1/d dropped)::

                 bf16 / fp16 (e = 2)     fp32 (e = 4)     Korthikanti (2-byte)
    none         37.3                    82.7              34 + 5·a·s/h
    selective    22.7                    53.3              34
    full         2                       4                 2

``docs/memory.md`` itemises the difference term by term (the s² term of an unfused softmax,
SwiGLU's f-wide tensors with f = 8h/3 against GELU's 4h, no dropout masks, fp32's x̂; under
``selective`` Megatron keeps the norm outputs and the GELU input and output, which we rebuild
or do not have: 22.7 against 34).

Outside the layers (first / last pipeline stage):

* embedding: T = 1: the token ids (N·8); vocab-parallel (1D T > 1, 2D): the local ids
  (N·8; 2D: the column-gathered [b, s] ids) and the out-of-range mask (N·1);
* final norm: one norm as above (its output kept by the head);
* head + loss (the **logits**): the loss upcasts the logits to fp32 in any precision. No TP:
  ``F.cross_entropy`` keeps the fp32 log-softmax N·V·4, the targets N·8 and a 4-byte total
  weight; 1D: the fp32 softmax block N·V_p/T·4, target index N·8 and two masks N·1; 2D:
  softmax N_r·V_p/q·4, index N_r·8, two masks N_r·1 and a 4-byte weight.

Asserted (``tests/test_memory_model.py``): the total equals the saved-tensor meter to the byte
for none / selective / full, in fp32 and under bf16 autocast on CPU, at T = 1 (none and 1D),
1D, 1D + SP (T = 2, 4, kv heads replicated), 2D (tied, grouped-query).

Context parallelism (``context`` C > 1, issue 25): every per-token tensor above holds the rank's
b·S/C tokens (the RoPE tables too, 2·(S/C)·d·e), and under recompute ``none`` each layer keeps one
more copy of the attention output, n·H_r·d·e (:func:`gridshard.theory.context.context_attention_saved_bytes`);
asserted against the meter for ring and all-to-all, every recompute mode, fp32 and bf16. The
attention's backward buffers (:func:`gridshard.theory.context.context_transient_bytes`) count in §3.

Pipeline (:func:`gridshard.theory.pipeline.peak_in_flight`): stage i of P holds the
activations of up to min(A, P − i) micro-batches under 1F1B, all A under GPipe
(:attr:`ActivationBytes.per_microbatch` each; the RoPE tables and weight copies once).

3. Prediction (:func:`predict_rank_memory`)
===========================================
``peak`` = baseline (measured by the caller just before the model is built: the Python,
torch and gloo footprint, i.e. peak RSS on CPU) + model state + comm buffers + ZeRO-3
transient + activations of the micro-batches in flight (with what is held once) + the logits
workspace (the e-byte logits and their fp32 upcast / gradient, N_r·V_r·(e + 4), alive around
the loss) + what of the step transient (bf16 ZeRO-0's fp32 master gradient, alive from the
reduction to the step, when the activations, workspace and backward transients are freed)
exceeds those — and, with a pipeline where the reducer does not reduce in the schedule's
backward (ZeRO-1, ``zero_bubble``, ``overlap_grad_reduce`` off: every unit in ``sync()``
afterwards; ZeRO-2/3 otherwise reduce every micro-batch inside it,
:func:`gridshard.theory.zero.reduces_in_backward`), what of ZeRO ≥ 1's reduction cast
(:func:`zero_reduce_cast_bytes`) exceeds the freed activations and workspace; with a pipeline
also the stage's receive buffers and kept outputs (:func:`gridshard.theory.pipeline.stage_buffer_bytes`,
in ``comm_buffers``) — a sum of maxima,
so an upper estimate; ``margin`` is stated separately (default 10 % of the modelled part)
for allocator slack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..job_layout import StageSplit, TensorMode
from .context import context_attention_saved_bytes, context_transient_bytes
from .zero import chunk_range, reduces_in_backward, unit_padded_numel, unit_shard_numel
from .pipeline import DTYPE_BYTES, boundary_bytes, peak_in_flight, stage_buffer_bytes

FP32 = 4
ADAM_STATES = 2                     # exp_avg, exp_avg_sq
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

    @property
    def numel(self) -> int:
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
    ``"root"``) → its blocks in the order given (:mod:`gridshard.zero.data_parallel`)."""
    units: dict = {}
    for b in _as_blocks(blocks):
        units.setdefault(b.layer if b.in_decoder_layer else "root", []).append(b)
    return units


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
                      step_counters: bool = True, param_bytes: int = FP32) -> ModelState:
    """Model-state bytes of one rank for its parameter blocks (module docstring §1).

    ``blocks``: :class:`ParamBlock` s or (local shape, decoder layer or None) pairs, each unit's
    in its parameter order; ``zero`` ∈ {0, 1, 2, 3}; ``data`` = D; ``data_rank`` which chunk this
    rank owns; ``step_counters`` counts AdamW's 4-byte ``step`` tensor per stepped parameter;
    ``param_bytes``: 4 (fp32 storage) or 2 (bf16 storage with fp32 masters, :func:`param_element_bytes`).
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
    D, units = data, zero_units(blocks)
    L = {u: unit_padded_numel([b.numel for b in bs], D) for u, bs in units.items()}
    C = sum(L.values()) // D
    s = sum(unit_shard_numel([b.numel for b in bs], D, data_rank) for bs in units.values())
    counters = STEP_COUNTER_BYTES * sum(_stepped_in_chunk(bs, D, data_rank) for bs in units.values())
    opt = ADAM_STATES * FP32 * s + (counters if step_counters else 0)
    master = FP32 * C if mixed else 0
    if zero == 1:
        return ModelState(p * sum(L.values()) + master, p * sum(L.values()), opt, comm_buffers=FP32 * C)
    if zero == 2:
        return ModelState(p * sum(L.values()) + master, FP32 * C, opt)
    layers = [v for u, v in L.items() if u != "root"]
    pairs = [a + b for a, b in zip(layers, layers[1:])] or layers
    transient = p * L.get("root", 0) + p * max(pairs, default=0)
    return ModelState(p * C + master, FP32 * C, opt, transient=transient)


def _units_padded(blocks: Sequence, data: int) -> dict:
    """L_u of every ZeRO unit of ``blocks`` (module docstring §1)."""
    return {u: unit_padded_numel([b.numel for b in bs], data) for u, bs in zero_units(blocks).items()}


def zero_reduce_cast_bytes(blocks: Sequence, zero: int, data: int, param_bytes: int = FP32,
                           reduce_bytes: int = FP32) -> int:
    """What reducing the units in flight adds under bf16 storage at ZeRO ≥ 1 (module docstring
    §1): each one's fp32 cast, 4·(L_root + L_(1) + L_(2) + L_(3)) with ``reduce_bytes`` 4, or its
    2-byte output chunk, 2·(…)/D, with 2; 0 at ZeRO-0 or with fp32 storage."""
    if zero == 0 or param_bytes >= FP32:
        return 0
    L = _units_padded(blocks, data)
    in_flight = L.get("root", 0) + sum(sorted((v for u, v in L.items() if u != "root"), reverse=True)[:3])
    return FP32 * in_flight if reduce_bytes >= FP32 else param_bytes * in_flight // data


def zero_accumulator_bytes(blocks: Sequence, zero: int, data: int, micro_batches: int = 1,
                           overlap: bool = True, param_bytes: int = FP32) -> int:
    """bf16 storage at ZeRO-0/1 with ``micro_batches`` > 1 (P = 1, D > 1, ``overlap``): the fp32
    accumulator each earlier micro-batch's bf16 gradients are added into (module docstring §1),
    4 bytes per gradient element — ZeRO-0: 4n (its fp32 reduced buffer, allocated at the first
    micro-batch instead of the reduction), ZeRO-1: 4·ΣL_u (freed unit by unit once reduced);
    0 otherwise."""
    if zero > 1 or param_bytes >= FP32 or micro_batches <= 1 or data <= 1 or not overlap:
        return 0
    return FP32 * (sum(b.numel for b in _as_blocks(blocks)) if zero == 0 else sum(_units_padded(blocks, data).values()))


def zero_gradient_transient(blocks: Sequence, zero: int, data: int, micro_batches: int = 1,
                            sharded_accumulation: bool = True, param_bytes: int = FP32,
                            reduce_bytes: int = FP32) -> int:
    """Gradient buffers alive during a ZeRO-2/3 backward (module docstring §1); for ZeRO-0/1,
    whose full gradients are already in the held state, 0 — under bf16 storage (``param_bytes``
    2) plus, at ZeRO ≥ 1, what the reduction of the units in flight adds in ``reduce_bytes``,
    and with ``micro_batches`` > 1 at D > 1 the fp32 accumulator (:func:`zero_accumulator_bytes`).
    ``sharded_accumulation``: the reducer reduces inside the backward
    (:func:`gridshard.theory.zero.reduces_in_backward`): ZeRO-2/3 reduce-scatter every micro-batch;
    ZeRO-0/1 under bf16 accumulate in fp32."""
    accumulator = zero_accumulator_bytes(blocks, zero, data, micro_batches, sharded_accumulation, param_bytes)
    if accumulator:                                    # ZeRO-1 fp32 reduce sends the accumulator itself: no cast
        return accumulator + (zero_reduce_cast_bytes(blocks, zero, data, param_bytes, reduce_bytes)
                              if zero == 1 and reduce_bytes < FP32 else 0)
    if zero == 0:
        return 0
    L = _units_padded(blocks, data)
    layers = sorted((v for u, v in L.items() if u != "root"), reverse=True)
    in_flight = L.get("root", 0) + sum(layers[:3])
    cast = zero_reduce_cast_bytes(blocks, zero, data, param_bytes, reduce_bytes)
    if zero < 2:
        return cast
    if micro_batches > 1 and not sharded_accumulation:
        return param_bytes * sum(L.values()) + cast
    return param_bytes * in_flight + cast


# ---------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------
@dataclass
class ActivationBytes:
    """Bytes kept for backward by one micro-batch's forward on one rank (module docstring §2).
    ``rope_tables`` and ``weight_copies`` are held once per rank whatever the micro-batches in
    flight (the model's RoPE cache; autocast's weight copies, cached for the autocast region)."""

    per_layer: int
    layers: int
    rope_tables: int
    embedding: int
    final_norm: int
    head_and_loss: int
    weight_copies: int = 0

    @property
    def decoder(self) -> int:
        return self.per_layer * self.layers

    @property
    def per_microbatch(self) -> int:
        """What each micro-batch in flight adds: decoder layers, embedding, final norm, head + loss."""
        return self.decoder + self.embedding + self.final_norm + self.head_and_loss

    @property
    def held_once(self) -> int:
        """What the rank holds once, however many micro-batches are in flight."""
        return self.rope_tables + self.weight_copies

    @property
    def total(self) -> int:
        """One micro-batch's forward: what the saved-tensor meter counts."""
        return self.per_microbatch + self.held_once


@dataclass(frozen=True)
class RankShape:
    """Per-rank sizes of one micro-batch in one tensor mode (module docstring §2), answered by the
    mode's scheme (:meth:`gridshard.tensor.base.Scheme.rank_shape`)."""

    token_rows: int           # N_r
    residual: int             # R elements of the residual stream
    heads: int                # H_r
    kv_heads: int             # K_r
    ffn: int                  # f_r
    vocab_block: int          # logits columns of this rank


def _rank_shape(cfg, mode, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
    return TensorMode.parse(mode).rank_shape(cfg, T, sequence_parallel, tokens)


def activation_element_bytes(precision: str) -> int:
    """e: bytes of an activation element under ``train.precision`` (4 fp32, 2 bf16/fp16)."""
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision is {precision!r}, not one of {sorted(DTYPE_BYTES)}. Fix: use one of them.")
    return DTYPE_BYTES[precision]


def norm_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, e: int = FP32,
                     rebuilt: bool = False) -> int:
    """One RMSNorm and the input its consumer keeps (module docstring §2, ``norm``): x, the fp32
    rstd and y, plus x̂ for fp32 (``F.rms_norm`` decomposed) outside 2D. ``rebuilt`` (a decoder
    layer's norm under ``selective``, :mod:`gridshard.nn.rebuild`): y is not kept."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    consumer_input = 0 if rebuilt else r.residual * e   # y itself (under SP its sequence block, re-gathered)
    return TensorMode.parse(mode).norm_saved_bytes(cfg, T, r, e, consumer_input)


def layer_saved_tensors(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                        e: int = FP32, context: int = 1) -> dict:
    """What one decoder layer keeps for backward, tensor by tensor (module docstring §2): name →
    bytes, in forward order; the two norms as one entry each (:func:`norm_saved_bytes`). Under
    ``selective`` q, k, v are the core's inputs (before RoPE, same sizes), ``lse``, ``silu(g)``
    and ``silu(g)·u`` are absent and the norms keep x and rstd (+ x̂ in fp32) but not y (rebuilt
    in backward, :mod:`gridshard.nn.rebuild`); ``full`` keeps the layer input only. ``context`` C > 1
    (``tokens`` already the rank's b·2c): the attention output o_proj keeps is a copy
    (:func:`gridshard.theory.context.context_attention_saved_bytes`)."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    if recompute == "full":
        return {"input": r.residual * e}
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    n, d, f = r.token_rows, cfg.head_dim, r.token_rows * r.ffn * e
    if recompute == "selective":    # the core's log-sum-exp and silu(g) recomputed, y and silu(g)·u rebuilt
        norm = norm_saved_bytes(cfg, mode, T, sequence_parallel, tokens, e, rebuilt=True)
        return {"attn_norm (x, rstd)": norm, "q": n * r.heads * d * e, "k": n * r.kv_heads * d * e,
                "v": n * r.kv_heads * d * e, "attention output": n * r.heads * d * e,
                "mlp_norm (x, rstd)": norm, "gate g": f, "up u": f}
    norm = norm_saved_bytes(cfg, mode, T, sequence_parallel, tokens, e)
    out = {"attn_norm (x, rstd, y)": norm, "q": n * r.heads * d * e, "k": n * r.kv_heads * d * e,
           "v": n * r.kv_heads * d * e, "attention output": n * r.heads * d * e, "lse": n * r.heads * FP32,
           "mlp_norm (x, rstd, y)": norm, "gate g": f, "silu(g)": f, "up u": f, "silu(g)·u": f}
    extra = context_attention_saved_bytes(context, n, r.heads, d, e, recompute)
    return {**out, "o_proj input (C > 1 copy)": extra} if extra else out


def layer_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                      e: int = FP32, context: int = 1) -> int:
    """Bytes one decoder layer keeps for backward, activations only (module docstring §2; the
    weight copies of autocast are :func:`weight_copy_bytes`): the sum of :func:`layer_saved_tensors`."""
    return sum(layer_saved_tensors(cfg, mode, T, sequence_parallel, tokens, recompute, e, context).values())


def weight_copy_bytes(cfg, mode: str, T: int, layers: int, has_head: bool, recompute: str = "none",
                      e: int = FP32, param_bytes: int = FP32) -> int:
    """Autocast's e-byte copies of the weights that autograd keeps (module docstring §2, "weight
    copies"): 0 when parameters are already e-byte; else the weights multiplied through
    ``F.linear``/SUMMA (none and 2D: all; 1D: the row layers o_proj and down_proj), per decoder
    layer unless ``full`` recompute, and the head's on the last stage (none, 2D)."""
    if e >= param_bytes:
        return 0
    per_layer, head = TensorMode.parse(mode).autocast_weight_elements(cfg, T)
    return e * ((0 if recompute == "full" else per_layer * layers) + (head if has_head else 0))


def embedding_saved_bytes(mode: str, T: int, tokens: int) -> int:
    """Token ids (N·8), plus the out-of-range mask (N·1) when the table is split."""
    return TensorMode.parse(mode).embedding_saved_bytes(T, tokens)


def head_and_loss_saved_bytes(cfg, mode: str, T: int, tokens: int, e: int = FP32) -> int:
    """The fp32 (log-)softmax over this rank's logits block and the loss's targets/masks (any precision:
    the loss upcasts the logits); at 3D with a tied head also :func:`gridshard.tensor.tp3d.scheme.tied_head_saved_bytes` (the scheme's ``head_and_loss_saved_bytes``)."""
    return TensorMode.parse(mode).head_and_loss_saved_bytes(cfg, T, _rank_shape(cfg, mode, T, False, tokens), e)


def activation_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", layers: Optional[int] = None,
                     has_embedding: bool = True, has_head: bool = True, precision: str = "fp32",
                     param_bytes: int = FP32, context: int = 1) -> ActivationBytes:
    """Activation bytes one micro-batch keeps on one rank (module docstring §2).

    ``micro_batch``: sequences of the tensor group's micro-batch (2D splits them over grid
    rows here); ``layers``: decoder layers on this rank (default all); ``has_embedding`` /
    ``has_head``: first / last pipeline stage; ``precision``: ``train.precision`` (activations
    in its compute dtype, e = 4 or 2); ``param_bytes``: bytes of a stored parameter element
    (4: fp32 parameters, which autocast copies to e bytes); ``context``: C, the context ranks
    ``seq_len`` is split over — every per-token tensor, the RoPE tables included, holds the rank's
    b·S/C tokens, plus the C > 1 attention term
    (:func:`gridshard.theory.context.context_attention_saved_bytes`)."""
    s_r = seq_len // context                     # the rank's 2c tokens of every sequence
    N = micro_batch * s_r
    e = activation_element_bytes(precision)
    sp = TensorMode.parse(mode).sequence_parallel_in_effect(sequence_parallel, T)
    L = cfg.layers if layers is None else layers
    return ActivationBytes(
        per_layer=layer_saved_bytes(cfg, mode, T, sp, N, recompute, e, context),
        layers=L,
        rope_tables=2 * s_r * cfg.head_dim * e if L else 0,
        embedding=embedding_saved_bytes(mode, T, N) if has_embedding else 0,
        final_norm=norm_saved_bytes(cfg, mode, T, sp, N, e) if has_head else 0,
        head_and_loss=head_and_loss_saved_bytes(cfg, mode, T, N, e) if has_head else 0,
        weight_copies=weight_copy_bytes(cfg, mode, T, L, has_head, recompute, e, param_bytes),
    )


def logits_workspace_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1,
                           precision: str = "fp32") -> int:
    """The logits block (e bytes) and its fp32 upcast / gradient, alive around the loss but not
    saved: N_r·V_r·(e + 4) (2·N_r·V_r·4 in fp32)."""
    r = _rank_shape(cfg, mode, T, False, micro_batch * seq_len)
    return r.token_rows * r.vocab_block * (activation_element_bytes(precision) + FP32)


# ---------------------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------------------
@dataclass
class RankMemory:
    """Predicted peak memory of one rank (module docstring §3). ``total`` excludes
    ``margin``; ``total_with_margin`` adds it."""

    baseline: int              # measured before the model was built (+ ``extra_bytes``)
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    transient: int
    margin_fraction: float = 0.10
    details: dict = field(default_factory=dict)

    @property
    def modelled(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm_buffers + self.transient

    @property
    def total(self) -> int:
        return self.baseline + self.modelled

    @property
    def margin(self) -> int:
        return int(self.margin_fraction * self.modelled)

    @property
    def total_with_margin(self) -> int:
        return self.total + self.margin


def _activation_terms(cfg, mode, T, sequence_parallel, recompute, micro_batch, seq_len, layer_ids, first, last,
                      precision, pb, P, n_microbatches, in_flight, context, context_mode) -> tuple:
    """(:class:`ActivationBytes`, logits workspace, stage buffers, attention backward buffers) of
    one rank (:func:`predict_rank_memory`). At C > 1 (``context``) every per-token term holds the
    rank's s_r = S/C tokens of each sequence (activations, logits workspace, stage buffers), the
    attention keeps the C > 1 term of :func:`gridshard.theory.context.context_attention_saved_bytes`
    and its backward holds the buffers of :func:`gridshard.theory.context.context_transient_bytes`
    (they exist once the head's backward has freed the logits workspace: the caller counts only
    what exceeds it); the ring's buffers hold the rank's sequences (m; m/q in 2D, m/q² in 3D) and heads."""
    s_r = seq_len // context
    acts = activation_bytes(cfg, micro_batch, seq_len, mode, T, sequence_parallel, recompute, len(layer_ids),
                            has_embedding=first, has_head=last, precision=precision, param_bytes=pb, context=context)
    workspace = logits_workspace_bytes(cfg, micro_batch, s_r, mode, T, precision) if last else 0
    stage_buffers = 0 if P == 1 else stage_buffer_bytes(first, last, n_microbatches, in_flight, boundary_bytes(
        mode, sequence_parallel, T, micro_batch, s_r, cfg.hidden, precision))
    r = _rank_shape(cfg, mode, T, sequence_parallel, micro_batch * s_r)
    ring = context_transient_bytes(context, context_mode, r.token_rows // s_r, s_r, r.heads, r.kv_heads, cfg.head_dim,
                                   activation_element_bytes(precision)) if layer_ids else 0
    return acts, workspace, stage_buffers, ring


def _reduction_terms(blocks, zero: int, data: int, A: int, P: int, overlap: bool, pb: int, rb: int) -> tuple:
    """(gradient bytes of the backward, late cast) of :func:`predict_rank_memory`. ``overlap``: the
    reducer reduces in the backward (:func:`gridshard.theory.zero.reduces_in_backward`: ZeRO-2/3's
    sharded accumulation, ZeRO-0/1's fp32 accumulation under bf16); without it in a pipeline (ZeRO-0/1,
    ``zero_bubble``) the reduction runs in ``sync()`` once the schedule's backward freed the
    activations, so its cast (:func:`zero_reduce_cast_bytes`) is *late*: taken out of the backward."""
    late = zero_reduce_cast_bytes(blocks, zero, data, pb, rb) if P > 1 and not overlap else 0
    return zero_gradient_transient(blocks, zero, data, A, sharded_accumulation=overlap, param_bytes=pb,
                                   reduce_bytes=rb) - late, late


def predict_rank_memory(cfg, *, mode: str = "none", T: int = 1, sequence_parallel: bool = False, data: int = 1,
                        data_rank: int = 0, zero: int = 0, recompute: str = "none", micro_batch: int = 1,
                        seq_len: int = 128, n_microbatches: int = 1, pipeline: int = 1, pipeline_rank: int = 0,
                        schedule: str = "1f1b", layer_ids: Optional[Iterable[int]] = None,
                        baseline_bytes: int = 0, extra_bytes: int = 0, margin_fraction: float = 0.10,
                        blocks: Sequence, precision: str = "fp32",
                        grad_reduce_dtype: str = "fp32", context: int = 1, context_mode: str = "ring",
                        overlap_grad_reduce: bool = True) -> RankMemory:
    """Peak bytes of one rank = ``baseline_bytes`` (measured before the model is built) +
    model state (:func:`model_state_bytes`) + activations of the micro-batches in flight
    (:attr:`ActivationBytes.per_microbatch` × :func:`gridshard.theory.pipeline.peak_in_flight`; one
    without pipeline: accumulation runs micro-batches one after another; the RoPE tables and
    autocast's weight copies once, :attr:`ActivationBytes.held_once`) in the compute dtype of
    ``precision`` (``train.precision``) + the logits workspace +
    ``extra_bytes`` (other resident bytes the caller knows of and the baseline missed, e.g.
    token arrays loaded after it was measured). No data-parallel gradient copy: ZeRO-0 all-reduces its persistent
    gradient buffer in place (:mod:`gridshard.zero.data_parallel`).

    Pipeline: one stage per rank (``pipeline_rank`` = stage), ``layer_ids`` its layers
    (default: the pipeline's own split, :class:`gridshard.job_layout.StageSplit`); the first
    stage holds the embedding, the last the final norm, head and loss; the stage's receive buffers
    and kept outputs (:func:`gridshard.theory.pipeline.stage_buffer_bytes`) count as comm buffers,
    and a ZeRO reduction in ``sync()`` after the schedule (:func:`_reduction_terms`; ``overlap_grad_reduce``)
    counts after the activations are freed, as the step transient does (module docstring §3). ``blocks``: the rank's
    :class:`ParamBlock` s, read by the caller from a model laid out on the meta device
    (:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`, or the planner's memo of it).
    ``precision`` bf16 also means bf16 parameter storage with fp32 masters (model state,
    :func:`param_element_bytes`; no autocast weight copies); ``grad_reduce_dtype``
    (``train.grad_reduce_dtype``) prices the ZeRO reduction's transient.

    Context parallelism (``context`` C > 1, ``context_mode``): :func:`_activation_terms`; the caller
    passes ``data`` = D·C and the rank's index among them (ZeRO shards over data × context)."""
    P = pipeline
    if layer_ids is None:
        layer_ids = StageSplit.of(cfg.layers, P).rank_layer_ids(pipeline_rank) if P > 1 else range(cfg.layers)
    layer_ids = list(layer_ids)
    first, last = pipeline_rank == 0, pipeline_rank == P - 1
    pb = param_element_bytes(precision)               # bf16: bf16 storage, fp32 masters, no weight copies
    state = model_state_bytes(blocks, zero, data, data_rank, param_bytes=pb)
    in_flight = peak_in_flight(pipeline_rank, P, n_microbatches, schedule) if P > 1 else 1
    acts, workspace, stage_buffers, ring = _activation_terms(
        cfg, mode, T, sequence_parallel, recompute, micro_batch, seq_len, layer_ids, first, last, precision, pb,
        P, n_microbatches, in_flight, context, context_mode)
    overlap = reduces_in_backward(zero, data, P, schedule, overlap_grad_reduce)
    grads, late = _reduction_terms(blocks, zero, data, n_microbatches, P, overlap, pb,
                                   param_element_bytes(grad_reduce_dtype))
    backward = state.transient + grads
    freed = acts.per_microbatch * in_flight + workspace      # gone when the step's (or late reduction's) transient exists
    # bf16 ZeRO-0 accumulating in its fp32 reduced buffer: the step's 18 bytes/param are within the backward's 20
    step = 0 if zero_accumulator_bytes(blocks, zero, data, n_microbatches, overlap, pb) and zero == 0 \
        else state.step_transient
    return RankMemory(baseline=int(baseline_bytes) + int(extra_bytes), params=state.params, grads=state.grads,
                      optimizer=state.optimizer,
                      activations=acts.per_microbatch * in_flight + acts.held_once + workspace,
                      comm_buffers=state.comm_buffers + stage_buffers,
                      transient=backward + max(0, step + late - freed) + max(0, ring - workspace),
                      margin_fraction=margin_fraction,
                      details={"activation_per_microbatch": acts.per_microbatch, "in_flight": in_flight,
                               "logits_workspace": workspace, "per_layer": acts.per_layer,
                               "stage_buffers": stage_buffers, "context_transient": ring})


__all__ = ["ParamBlock", "kv_replica_grad_extra", "ModelState", "model_state_bytes", "zero_gradient_transient",
           "zero_reduce_cast_bytes", "zero_accumulator_bytes",
           "param_element_bytes",
           "zero_units",
           "ActivationBytes", "activation_bytes", "activation_element_bytes", "layer_saved_bytes",
           "layer_saved_tensors", "norm_saved_bytes",
           "weight_copy_bytes", "embedding_saved_bytes",
           "head_and_loss_saved_bytes", "logits_workspace_bytes", "RankMemory", "predict_rank_memory"]
