"""Memory per rank, §3: the predicted peak of one rank.

Notation: see :mod:`gridshard.theory.memory`; model state: :mod:`.model_state` (§1); activations:
:mod:`.activations` (§2).

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
so an upper estimate; ``margin`` is stated separately for the allocator's slack: 10 % by default
of what the step allocates and frees again (:attr:`RankMemory.churning`: activations, buffers,
transients), not of the model state, laid out once and held.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ...job_layout import StageSplit
from ..context import context_transient_bytes
from ..pipeline import (boundary_bytes, interleaved_in_flight, peak_in_flight, sends_held, stage_buffer_bytes,
                        zero_bubble_in_flight)
from ..zero import reduces_in_backward
from .activations import _rank_shape, activation_bytes, activation_element_bytes, logits_workspace_bytes
from .model_state import (model_state_bytes, param_element_bytes, zero_accumulator_bytes, zero_gradient_transient,
                          zero_reduce_cast_bytes)


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
    def churning(self) -> int:
        """What the step allocates and frees again: activations, communication and stage buffers,
        transients. The model state (parameters, gradients, optimizer state) is laid out once in
        flat buffers at the start and held to the end, predicted to the byte (the ZeRO tests)."""
        return self.activations + self.comm_buffers + self.transient

    @property
    def margin(self) -> int:
        """``margin_fraction`` of :attr:`churning`: the allocator's slack lies in what it recycles."""
        return int(self.margin_fraction * self.churning)

    @property
    def total_with_margin(self) -> int:
        return self.total + self.margin


def _activation_terms(cfg, mode, T, sequence_parallel, recompute, micro_batch, seq_len, layer_ids, first, last,
                      precision, pb, P, in_flight, context, context_mode, expert=1,
                      documents=False) -> tuple:
    """(:class:`ActivationBytes`, logits workspace, stage buffers, attention backward buffers) of
    one rank (:func:`predict_rank_memory`). At C > 1 (``context``) every per-token term holds the
    rank's s_r = S/C tokens of each sequence (activations, logits workspace, stage buffers), the
    attention keeps the C > 1 term of :func:`gridshard.theory.context.context_attention_saved_bytes`
    and its backward holds the buffers of :func:`gridshard.theory.context.context_transient_bytes`
    (they exist once the head's backward has freed the logits workspace: the caller counts only
    what exceeds it); the ring's buffers hold the rank's sequences (m; m/q in 2D, m/q² in 3D) and heads."""
    s_r = seq_len // context
    moe = sum(map(cfg.is_moe_layer, layer_ids)) if getattr(cfg, "experts", 0) else 0
    acts = activation_bytes(cfg, micro_batch, seq_len, mode, T, sequence_parallel, recompute, len(layer_ids),
                            has_embedding=first, has_head=last, precision=precision, param_bytes=pb, context=context,
                            moe_layers=moe, expert=expert, context_mode=context_mode, documents=documents)
    workspace = logits_workspace_bytes(cfg, micro_batch, s_r, mode, T, precision) if last else 0
    stage_buffers = 0 if P == 1 else stage_buffer_bytes(last, in_flight, boundary_bytes(
        mode, sequence_parallel, T, micro_batch, s_r, cfg.hidden, precision))
    r = _rank_shape(cfg, mode, T, sequence_parallel, micro_batch * s_r)
    ring = context_transient_bytes(context, context_mode, r.token_rows // s_r, s_r, r.heads, r.kv_heads, cfg.head_dim,
                                   activation_element_bytes(precision)) if layer_ids else 0
    return acts, workspace, stage_buffers, ring


def _reduction_terms(blocks, zero: int, data: int, A: int, P: int, overlap: bool, pb: int, rb: int,
                     expert: int = 1) -> tuple:
    """(gradient bytes of the backward, late cast) of :func:`predict_rank_memory`. ``overlap``: the
    reducer reduces in the backward (:func:`gridshard.theory.zero.reduces_in_backward`: ZeRO-2/3's
    sharded accumulation, ZeRO-0/1's fp32 accumulation under bf16); without it in a pipeline (ZeRO-0/1,
    ``zero_bubble``) the reduction runs in ``sync()`` once the schedule's backward freed the
    activations, so its cast (:func:`zero_reduce_cast_bytes`) is *late*: taken out of the backward."""
    late = zero_reduce_cast_bytes(blocks, zero, data, pb, rb, expert) if P > 1 and not overlap else 0
    return zero_gradient_transient(blocks, zero, data, A, sharded_accumulation=overlap, param_bytes=pb,
                                   reduce_bytes=rb, expert=expert) - late, late


def predict_rank_memory(cfg, *, mode: str = "none", T: int = 1, sequence_parallel: bool = False, data: int = 1,
                        data_rank: int = 0, zero: int = 0, recompute: str = "none", micro_batch: int = 1,
                        seq_len: int = 128, n_microbatches: int = 1, pipeline: int = 1, pipeline_rank: int = 0,
                        schedule: str = "1f1b", layer_ids: Optional[Iterable[int]] = None,
                        baseline_bytes: int = 0, extra_bytes: int = 0, margin_fraction: float = 0.10,
                        blocks: Sequence, precision: str = "fp32",
                        grad_reduce_dtype: str = "fp32", context: int = 1, context_mode: str = "ring",
                        overlap_grad_reduce: bool = True, expert: int = 1, documents: bool = False) -> RankMemory:
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
    passes ``data`` = D·C and the rank's index among them (ZeRO shards over data × context).
    ``expert``: E, an MoE model's expert ranks (split experts sharded over D·C/E ranks, §1).
    ``documents``: packed windows with document masks (``data.document_mask``,
    :func:`gridshard.theory.memory.activations.document_mask_bytes`)."""
    P = pipeline
    if layer_ids is None:
        layer_ids = StageSplit.of(cfg.layers, P).rank_layer_ids(pipeline_rank) if P > 1 else range(cfg.layers)
    layer_ids = list(layer_ids)
    first, last = pipeline_rank == 0, pipeline_rank == P - 1
    pb = param_element_bytes(precision)               # bf16: bf16 storage, fp32 masters, no weight copies
    state = model_state_bytes(blocks, zero, data, data_rank, param_bytes=pb, expert=expert)
    in_flight = peak_in_flight(pipeline_rank, P, n_microbatches, schedule) if P > 1 else 1
    acts, workspace, stage_buffers, ring = _activation_terms(
        cfg, mode, T, sequence_parallel, recompute, micro_batch, seq_len, layer_ids, first, last, precision, pb,
        P, in_flight, context, context_mode, expert, documents)
    overlap = reduces_in_backward(zero, data, P, schedule, overlap_grad_reduce)
    grads, late = _reduction_terms(blocks, zero, data, n_microbatches, P, overlap, pb,
                                   param_element_bytes(grad_reduce_dtype), expert)
    backward = state.transient + grads
    freed = acts.per_microbatch * in_flight + workspace      # gone when the step's (or late reduction's) transient exists
    # bf16 ZeRO-0 accumulating in its fp32 reduced buffer: the step's 18 bytes/param are within the backward's 20
    step = 0 if zero_accumulator_bytes(blocks, zero, data, n_microbatches, overlap, pb, expert) and zero == 0 \
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


def with_virtual_stages(mem: RankMemory, *, schedule: str, rank: int, P: int, V: int, A: int,
                        per_boundary: int) -> RankMemory:
    """``mem`` (one stage per rank, as :func:`predict_rank_memory` prices it) for a rank that runs V
    stages: interleaved 1F1B holds :func:`gridshard.theory.pipeline.interleaved_in_flight`
    micro-batches of its layers, zero bubble :func:`gridshard.theory.pipeline.zero_bubble_in_flight`,
    instead of min(A, P − r) (the difference × the activation bytes per micro-batch is added); its
    stages keep one output per chunk in flight, at most V·held, one output gradient received and
    :func:`gridshard.theory.pipeline.sends_held` blocks of sends not yet given back:
    (V·held + 1 + sends)·``per_boundary`` bytes of comm buffers in place of the one stage's
    (:func:`gridshard.theory.pipeline.stage_buffer_bytes`). Other schedules, or P = 1: ``mem`` as it is.
    The one home of this adaptation: the trainer's prediction and the planner's both apply it."""
    if P == 1 or schedule not in ("interleaved_1f1b", "zero_bubble"):
        return mem
    held = interleaved_in_flight(rank, P, V, A) if schedule == "interleaved_1f1b" else zero_bubble_in_flight(P, V, A)
    extra = max(0, held - mem.details["in_flight"])
    buffers = stage_buffer_bytes(False, V * held + sends_held(schedule, rank, P), per_boundary) \
        - mem.details["stage_buffers"]
    return dataclasses.replace(mem, activations=mem.activations + extra * mem.details["activation_per_microbatch"],
                               comm_buffers=mem.comm_buffers + buffers,
                               details={**mem.details, "in_flight": mem.details["in_flight"] + extra,
                                        "stage_buffers": mem.details["stage_buffers"] + buffers})
