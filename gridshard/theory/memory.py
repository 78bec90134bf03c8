"""Memory per rank: model state by ZeRO stage, activations by tensor mode and recompute.

Arithmetic over shapes (no process groups, no tensors). The shapes of a rank's parameter
blocks are not described here: they are read from the layouts of the model laid out on the
meta device (:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`, which
:func:`predict_rank_memory` calls when not handed the blocks). The planner and the trainer's
``predicted_mem_bytes`` call these functions; ``tests/test_memory_model.py`` asserts them
against the tensors a real laid-out model holds.

Notation: h hidden, H heads, K kv heads, d = h/H, f MLP width, V vocabulary (V_p padded
to the tensor split), L layers, b micro-batch, s sequence, N = b·s tokens of a tensor
group's micro-batch, T tensor size (q = √T in 2D), D data size, P pipeline stages.

1. Model state (:func:`model_state_bytes`)
==========================================
Per parameter, n = numel of the rank's local tensor-parallel block (tied weights once; a
pipeline rank holds only its stages' parameters). ZeRO splits that block by rows over the
D data ranks (:mod:`gridshard.theory.zero`): this rank owns s = ``shard_numel`` elements,
and communication buffers use the padded segment p = ``padded_numel`` (every data rank's
segment equally long). What a rank holds after ``optimizer.step`` and before ``zero_grad``,
all fp32 (bf16/fp16 runs autocast with fp32 parameters, gradients and AdamW state: the
same 16 bytes per parameter as the seed's estimate)::

    stage   params   grads            optimizer (exp_avg + exp_avg_sq)   comm buffers
    0       4n       4n               8n                                  —
    1       4n       4n (full)        8s                                  4p  (reduce-scatter output;
                                                                              the shard's grad is a view)
    2       4n       4p (shard only)  8s                                  —
    3       4p       4p               8s                                  —   (+ transient below)

plus AdamW's ``step`` counter, a 0-dim fp32 tensor per parameter it steps (4 bytes each;
ZeRO ≥ 1: per parameter whose shard is not empty). With D = 1, s = p = n and every stage
equals stage 0 (up to the stage-1 buffer).

Gradients of stages 0 and 1 are autograd's ``.grad`` tensors; where one is a view into a
larger buffer the whole buffer stays alive. In our layers that happens once: 1D with more
tensor ranks than kv heads (T > K), where the k/v gradient is a view of the all-reduced
buffer of all K blocks and the q|k|v gradient matmul keeps the unused k, v rows behind q's
view: K·(n_k + n_v) extra gradient elements per layer (``ParamBlock.grad_extra``; a
``.clone()`` of the slice in ``sum_over_replicas``' backward would free them).

ZeRO-3 *transient*: during forward and backward one decoder layer's parameters are
gathered at a time — its full local blocks (4·Σn over the layer) plus the all-gather
output buffer they are copied out of (4·D·Σp) — and the *root* parameters (embedding,
final norm, head: not in a decoder layer) stay gathered from forward to the end of
backward (4·Σn_root)::

    transient = 4·Σ_root n + max over layers ℓ (4·Σ_ℓ n + 4·D·Σ_ℓ p)

ZeRO-2/3 *backward gradients* (:func:`zero_gradient_transient`): gradients are full blocks
until their unit (a decoder layer, or the root) is packed into its reduce-scatter buffer
(B_u = 4·D·Σ_u p) and dropped; at most 2 reduce-scatters are outstanding (+1 being packed),
bounded by the three largest buffers B_(1) ≥ B_(2) ≥ B_(3). With A > 1 micro-batches every full
gradient lives from the first backward to the last (accumulation without communication)::

    A = 1:  4·max_u Σ_u n + B_(1) + B_(2) + B_(3)        A > 1:  4·Σ n + B_(1) + B_(2) + B_(3)

2. Activations (:func:`activation_bytes`)
=========================================
The bytes autograd keeps for backward during one micro-batch's forward (counted once per
storage; parameters excluded), derived for gridshard's Llama block op by op as
Korthikanti et al. (2022) did for GPT. e = 4 (fp32). Let the rank's token rows be
N_r = N (none, 1D) or N/q (2D: the batch is split over grid rows); the residual stream
per rank is R = N·h (none, 1D), N·h/T (1D+SP: the sequence is split), N·h/q² (2D);
H_r, K_r, f_r the rank's heads, kv heads and MLP width: (H, K, f) without tensor
parallelism, (H/T, K/min(T, K), f/T) in 1D (kv heads replicated in groups when T > K),
(H/q, K/q, f/q) in 2D.

* **RMSNorm** (twice per layer). ``F.rms_norm`` on CPU runs as pow, mean, rsqrt, mul, mul:
  it keeps its input x (R·e), the reciprocal rms (R/h·4, one per token) and the normalised
  x̂ = x·rstd (R·e); the output y = x̂·w is kept by the projections that read it (R·e;
  under SP that is the sequence block, N·h/T·e: the column layers keep their block and
  all-gather it again in backward, :mod:`gridshard.comm.input_grad_overlap`, instead of
  keeping the gathered N·h·e). 2D (``RMSNorm2D``, one autograd function) keeps x (R·e), the
  rms (N_r·4), the gathered weight block (h/q·4) and, through the SUMMA product, y (R·e).
* **q|k|v** (one matmul on the shared input): keeps that input (counted above). Their
  outputs are kept by RoPE/attention below.
* **Attention core** (RoPE + ``scaled_dot_product_attention``, causal). RoPE's multiplies
  keep only the cos/sin tables ([s, d] fp32 each, built once per forward and shared by the
  layers: counted once per micro-batch, 2·s·d·4). PyTorch's SDPA on these shapes is the
  flash kernel (measured on CPU; GPU flash / memory-efficient kernels keep the same set):
  it keeps rotated q (N_r·H_r·d·e), rotated k and v (N_r·K_r·d·e each), its output
  (N_r·H_r·d·e) and the log-sum-exp (N_r·H_r·4), *not* the s×s score matrix —
  Korthikanti's 5·a·s²·b term belongs to an unfused softmax (and dropout, which we lack).
* **o_proj** (row/2D): keeps its input, which is the attention output already counted
  (a view of the same storage).
* **MLP**: gate output (for SiLU), SiLU output and up output (for the product), and the
  product (down's input): 4·N_r·f_r·e.
* Residual additions keep nothing.

Per layer, recompute ``none``::

    2·norm + N_r·d·(2·H_r + 2·K_r)·e + N_r·H_r·4 + 4·N_r·f_r·e
    norm = 2R·e + R/h·4 + R·e                      (none, 1D, 1D + SP: y, the block under SP)
         = 2R·e + N_r·4 + h/q·4                    (2D)

For comparison with Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes per GPT layer (2-byte
activations, 1-byte dropout masks): ours at T = 1 with K = H and f = 8h/3 is
s·b·h·(24 + 16 + 128/3) + small ≈ 82.7·s·b·h bytes in fp32 (≈ 41 in 2-byte units), with no s²
term. With 1D + SP every term is divided by T (the column inputs too, since they keep their
sequence block): ≈ 82.7·s·b·h/T in fp32, ≈ 41.3·s·b·h/T in 2-byte units, next to Korthikanti's
34·s·b·h/t for TP + SP + selective recompute (``docs/memory.md`` itemises the difference: the
norms' x̂, SwiGLU's four f-wide tensors with f = 8h/3, no dropout masks).

``selective`` (the attention core is a non-reentrant checkpoint): the core keeps its
inputs — q, k, v before RoPE (same sizes as after) and cos/sin (shared) — instead of its
activations, and its output stays kept by o_proj: the layer saves N_r·H_r·4 (the
log-sum-exp) less. ``full``: each decoder layer keeps only its input, R·e (+ the shared
cos/sin).

Outside the layers (first / last pipeline stage):

* embedding: T = 1: the token ids (N·8); vocab-parallel (1D T > 1, 2D): the local ids
  (N·8; 2D: the column-gathered [b, s] ids) and the out-of-range mask (N·1);
* final norm: one norm as above (its output kept by the head);
* head + loss (the **logits**): no TP: ``F.cross_entropy`` keeps the fp32 log-softmax
  N·V·4, the targets N·8 and a 4-byte total weight; 1D: the fp32 softmax block N·V_p/T·4,
  target index N·8 and two masks N·1; 2D: softmax N_r·V_p/q·4, index N_r·8, two masks
  N_r·1 and a 4-byte weight.

Precision: the formulas are for fp32 runs and asserted there. Under bf16 autocast the
projections keep bf16 copies of their inputs (one per projection) and of their weights,
norms, RoPE tables and the loss stay fp32: not modelled yet (the fp32 figure is then an
over-estimate of the activations, less the weight copies).

Pipeline (:func:`gridshard.theory.pipeline.peak_in_flight`): stage i of P holds the
activations of up to min(A, P − i) micro-batches under 1F1B, all A under GPipe.

3. Prediction (:func:`predict_rank_memory`)
===========================================
``peak`` = baseline (measured by the caller just before the model is built: the Python,
torch and gloo footprint, i.e. peak RSS on CPU) + model state + comm buffers + ZeRO-3
transient + activations of the micro-batches in flight + the logits workspace (the
logits tensor and its gradient, 2·N_r·V_r·4, alive around the loss) — a sum of maxima,
so an upper estimate; ``margin`` is stated separately (default 10 % of the modelled part)
for allocator slack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..job_layout import StageSplit, TensorMode
from .zero import padded_numel, shard_numel
from .pipeline import peak_in_flight
from .vocab import padded_vocab_size

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
    if not mode.splits_weights or mode.kv_replication(K, T) <= 1:
        return {}
    n_kv = mode.local_kv_heads(K, T) * cfg.head_dim * cfg.hidden
    return {"self_attn.q_proj.weight": 2 * n_kv, "self_attn.k_proj.weight": (K - 1) * n_kv,
            "self_attn.v_proj.weight": (K - 1) * n_kv}


def _grid_side(T: int) -> int:
    """q of a 2D grid of T = q² ranks (LayoutError, a ValueError, when T is not a square)."""
    TensorMode.TWO_D.check_tensor_size(T)
    return TensorMode.TWO_D.grid_side(T)


# ---------------------------------------------------------------------------------------
# model state
# ---------------------------------------------------------------------------------------
@dataclass
class ModelState:
    """Bytes one rank holds for parameters, gradients and optimizer state (module docstring §1).
    ``comm_buffers``: persistent ZeRO-1 reduce-scatter output; ``transient``: ZeRO-3's
    gathered parameters during forward/backward (not held at the end of a step)."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int = 0
    transient: int = 0

    @property
    def held(self) -> int:
        """What stays allocated between steps: params + grads + optimizer + comm buffers."""
        return self.params + self.grads + self.optimizer + self.comm_buffers

    @property
    def peak(self) -> int:
        return self.held + self.transient


def model_state_bytes(blocks: Sequence, zero: int = 0, data: int = 1, data_rank: int = 0,
                      step_counters: bool = True) -> ModelState:
    """Model-state bytes of one rank for its parameter blocks (module docstring §1, fp32).

    ``blocks``: :class:`ParamBlock` s or (local shape, decoder layer or None) pairs;
    ``zero`` ∈ {0, 1, 2, 3}; ``data`` = D; ``data_rank`` which row shard this rank owns;
    ``step_counters`` counts AdamW's 4-byte ``step`` tensor per stepped parameter.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    blocks = _as_blocks(blocks)
    D = data
    n = [b.numel for b in blocks]
    s = [shard_numel(b.shape, D, data_rank) for b in blocks]
    p = [padded_numel(b.shape, D) for b in blocks]
    counters = lambda sizes: STEP_COUNTER_BYTES * sum(1 for x in sizes if x > 0) if step_counters else 0  # noqa: E731
    full_grads = FP32 * sum(b.numel + b.grad_extra for b in blocks)
    if zero == 0:
        return ModelState(FP32 * sum(n), full_grads, ADAM_STATES * FP32 * sum(n) + counters(n))
    opt = ADAM_STATES * FP32 * sum(s) + counters(s)
    if zero == 1:
        return ModelState(FP32 * sum(n), full_grads, opt, comm_buffers=FP32 * sum(p))
    if zero == 2:
        return ModelState(FP32 * sum(n), FP32 * sum(p), opt)
    root = [b for b in blocks if not b.in_decoder_layer]
    by_layer: dict = {}
    for b in blocks:
        if b.in_decoder_layer:
            by_layer.setdefault(b.layer, []).append(b)
    layer_peak = max((FP32 * sum(b.numel for b in bs) + FP32 * D * sum(padded_numel(b.shape, D) for b in bs)
                      for bs in by_layer.values()), default=0)
    transient = FP32 * sum(b.numel for b in root) + layer_peak
    return ModelState(FP32 * sum(p), FP32 * sum(p), opt, transient=transient)


def zero_gradient_transient(blocks: Sequence, zero: int, data: int, micro_batches: int = 1) -> int:
    """Full gradients and packed reduce-scatter buffers alive during a ZeRO-2/3 backward
    (module docstring §1); 0 for ZeRO-0/1, whose full gradients are already in the held state."""
    if zero < 2:
        return 0
    blocks = _as_blocks(blocks)
    units: dict = {}
    for b in blocks:
        units.setdefault(b.layer if b.in_decoder_layer else "root", []).append(b)
    n_max = max((sum(b.numel for b in bs) for bs in units.values()), default=0)
    buffers = sorted((data * sum(padded_numel(b.shape, data) for b in bs) for bs in units.values()), reverse=True)
    full = sum(b.numel for b in blocks) if micro_batches > 1 else n_max
    return FP32 * full + FP32 * sum(buffers[:3])


# ---------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------
@dataclass
class ActivationBytes:
    """Bytes kept for backward by one micro-batch on one rank (module docstring §2)."""

    per_layer: int
    layers: int
    rope_tables: int
    embedding: int
    final_norm: int
    head_and_loss: int

    @property
    def decoder(self) -> int:
        return self.per_layer * self.layers

    @property
    def total(self) -> int:
        return self.decoder + self.rope_tables + self.embedding + self.final_norm + self.head_and_loss


@dataclass(frozen=True)
class _RankShape:
    """Per-rank sizes of one micro-batch in one tensor mode (module docstring §2)."""

    token_rows: int           # N_r
    residual: int             # R elements of the residual stream
    heads: int                # H_r
    kv_heads: int             # K_r
    ffn: int                  # f_r
    vocab_block: int          # logits columns of this rank


def _rank_shape(cfg, mode, T: int, sequence_parallel: bool, tokens: int) -> _RankShape:
    h, H, K, f, V = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab_size
    mode = TensorMode.parse(mode)
    if not mode.splits_weights:
        return _RankShape(tokens, tokens * h, H, K, f, V)
    if mode.is_1d:
        R = tokens * h // T if mode.sequence_parallel_in_effect(sequence_parallel, T) else tokens * h
        return _RankShape(tokens, R, H // T, mode.local_kv_heads(K, T), f // T, padded_vocab_size(V, T) // T)
    q = _grid_side(T)
    return _RankShape(tokens // q, tokens * h // T, H // q, K // q, f // q, padded_vocab_size(V, q) // q)


def norm_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, e: int = FP32) -> int:
    """One RMSNorm and the input its consumer keeps (module docstring §2, ``norm``)."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    h = cfg.hidden
    if TensorMode.parse(mode).is_grid:
        q = _grid_side(T)
        return 2 * r.residual * e + r.token_rows * FP32 + (h // q) * FP32
    consumer_input = r.residual * e            # y itself (under SP its sequence block, re-gathered in backward)
    return 2 * r.residual * e + (r.residual // h) * FP32 + consumer_input


def layer_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                      e: int = FP32) -> int:
    """Bytes one decoder layer keeps for backward (module docstring §2)."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    if recompute == "full":
        return r.residual * e
    d = cfg.head_dim
    norms = 2 * norm_saved_bytes(cfg, mode, T, sequence_parallel, tokens, e)
    attention = r.token_rows * d * (2 * r.heads + 2 * r.kv_heads) * e
    logsumexp = r.token_rows * r.heads * FP32
    mlp = 4 * r.token_rows * r.ffn * e
    if recompute == "selective":
        logsumexp = 0
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    return norms + attention + logsumexp + mlp


def embedding_saved_bytes(mode: str, T: int, tokens: int) -> int:
    """Token ids (N·8), plus the out-of-range mask (N·1) when the table is split."""
    split = TensorMode.parse(mode).splits_weights and T > 1
    return tokens * INDEX_BYTES + (tokens * MASK_BYTES if split else 0)


def head_and_loss_saved_bytes(cfg, mode: str, T: int, tokens: int) -> int:
    """The fp32 (log-)softmax over this rank's logits block and the loss's targets/masks."""
    r = _rank_shape(cfg, mode, T, False, tokens)
    n = r.token_rows
    mode = TensorMode.parse(mode)
    if not mode.splits_weights:
        return n * r.vocab_block * FP32 + n * INDEX_BYTES + FP32
    if mode.is_1d:
        return n * r.vocab_block * FP32 + n * INDEX_BYTES + 2 * n * MASK_BYTES
    return n * r.vocab_block * FP32 + n * INDEX_BYTES + 2 * n * MASK_BYTES + FP32


def activation_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", layers: Optional[int] = None,
                     has_embedding: bool = True, has_head: bool = True) -> ActivationBytes:
    """Activation bytes one micro-batch keeps on one rank (fp32; module docstring §2).

    ``micro_batch``: sequences of the tensor group's micro-batch (2D splits them over grid
    rows here); ``layers``: decoder layers on this rank (default all); ``has_embedding`` /
    ``has_head``: first / last pipeline stage."""
    N = micro_batch * seq_len
    sp = TensorMode.parse(mode).sequence_parallel_in_effect(sequence_parallel, T)
    L = cfg.layers if layers is None else layers
    return ActivationBytes(
        per_layer=layer_saved_bytes(cfg, mode, T, sp, N, recompute),
        layers=L,
        rope_tables=2 * seq_len * cfg.head_dim * FP32 if L else 0,
        embedding=embedding_saved_bytes(mode, T, N) if has_embedding else 0,
        final_norm=norm_saved_bytes(cfg, mode, T, sp, N) if has_head else 0,
        head_and_loss=head_and_loss_saved_bytes(cfg, mode, T, N) if has_head else 0,
    )


def logits_workspace_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1) -> int:
    """The logits block and its gradient (fp32), alive around the loss but not saved: 2·N_r·V_r·4."""
    r = _rank_shape(cfg, mode, T, False, micro_batch * seq_len)
    return 2 * r.token_rows * r.vocab_block * FP32


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


def predict_rank_memory(cfg, *, mode: str = "none", T: int = 1, sequence_parallel: bool = False, data: int = 1,
                        data_rank: int = 0, zero: int = 0, recompute: str = "none", micro_batch: int = 1,
                        seq_len: int = 128, n_microbatches: int = 1, pipeline: int = 1, pipeline_rank: int = 0,
                        schedule: str = "1f1b", layer_ids: Optional[Iterable[int]] = None,
                        baseline_bytes: int = 0, extra_bytes: int = 0, margin_fraction: float = 0.10,
                        blocks: Optional[Sequence] = None) -> RankMemory:
    """Peak bytes of one rank = ``baseline_bytes`` (measured before the model is built) +
    model state (:func:`model_state_bytes`) + activations of the micro-batches in flight
    (:func:`activation_bytes` × :func:`gridshard.theory.pipeline.peak_in_flight`; one without
    pipeline: accumulation runs micro-batches one after another) + the logits workspace +
    ``extra_bytes`` (other resident bytes the caller knows of and the baseline missed, e.g.
    token arrays loaded after it was measured). No data-parallel gradient copy: ZeRO-0 all-reduces its persistent
    gradient buffer in place (:mod:`gridshard.zero.grad_buffer`).

    Pipeline: one stage per rank (``pipeline_rank`` = stage), ``layer_ids`` its layers
    (default: the pipeline's own split, :class:`gridshard.job_layout.StageSplit`); the first
    stage holds the embedding, the last the final norm, head and loss. ``blocks``: the rank's
    :class:`ParamBlock` s when the caller has them (the planner's memo), else read from a model
    laid out on the meta device (:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`)."""
    P = pipeline
    if layer_ids is None:
        layer_ids = StageSplit.of(cfg.layers, P).rank_layer_ids(pipeline_rank) if P > 1 else range(cfg.layers)
    layer_ids = list(layer_ids)
    first, last = pipeline_rank == 0, pipeline_rank == P - 1
    if blocks is None:
        from ..parallel.rank_blocks import rank_parameter_blocks     # lazy: parallel builds on theory

        blocks = rank_parameter_blocks(cfg, mode, T, layer_ids, has_embedding=first, has_head=last)
    state = model_state_bytes(blocks, zero, data, data_rank)
    acts = activation_bytes(cfg, micro_batch, seq_len, mode, T, sequence_parallel, recompute, len(layer_ids),
                            has_embedding=first, has_head=last)
    in_flight = peak_in_flight(pipeline_rank, P, n_microbatches, schedule) if P > 1 else 1
    workspace = logits_workspace_bytes(cfg, micro_batch, seq_len, mode, T) if last else 0
    return RankMemory(baseline=int(baseline_bytes) + int(extra_bytes), params=state.params, grads=state.grads,
                      optimizer=state.optimizer, activations=acts.total * in_flight + workspace,
                      comm_buffers=state.comm_buffers,
                      transient=state.transient + zero_gradient_transient(blocks, zero, data, n_microbatches),
                      margin_fraction=margin_fraction,
                      details={"activation_per_microbatch": acts.total, "in_flight": in_flight,
                               "logits_workspace": workspace, "per_layer": acts.per_layer})


__all__ = ["ParamBlock", "kv_replica_grad_extra", "ModelState", "model_state_bytes", "zero_gradient_transient",
           "ActivationBytes", "activation_bytes", "layer_saved_bytes", "norm_saved_bytes", "embedding_saved_bytes",
           "head_and_loss_saved_bytes", "logits_workspace_bytes", "RankMemory", "predict_rank_memory"]
