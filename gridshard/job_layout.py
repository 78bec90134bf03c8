"""The job layout: every fact derived from a validated config, decided in one place.

A job of G = D·P·C·T processes (data × pipeline × context × tensor) is described by a config whose
strings and flags imply further facts. They are derived here, once, and everything else
reads them (as torchtitan's ``ParallelDims``):

================================  ============================================================
fact                              rule
================================  ============================================================
tensor mode                       the registered scheme (:mod:`gridshard.tensor_scheme`, ``TensorMode``:
                                  ``none`` | ``1d`` | ``2d`` | ``2.5d`` | ``3d`` | a registered one),
                                  parsed once from ``parallel.tensor_mode``; its string is the config's
                                  and the metrics' value, its methods the rules below
grid side q                       2D: T = q², q = √T (``mode.side(T)``)
cube side q                       3D: T = q³, q = ∛T (``mode.side(T)``); a rank holds 1/T of
                                  every weight and [b/q², s, h/q] of an activation: tokens of batch
                                  block i·q + j, logits (and so targets) of block i·q + l (the
                                  mesh's ``batch_index`` / ``logits_batch_index``, :mod:`gridshard.mesh`)
2.5D depth layers                 T = q²·d (``parallel.tensor_depth`` d); every depth layer is the 2D
                                  layout on its q² ranks: ``mode.layer_layout(T, d)`` = (2d, q²) is
                                  what the layers, shapes and memory model read, and the depth joins
                                  the data ranks in the gradient reduction (``JobLayout.depth``)
sequence parallelism in effect    requested ∧ mode = 1d ∧ T > 1
                                  (``mode.sequence_parallel_in_effect(requested, T)``)
ranks one head dim is split over  1d: T; 2d and 3d: q; none: 1 (``mode.head_split(T)``)
local kv heads, kv replication    1d: K/T heads per rank when T divides K; one head shared by
                                  r = T/K ranks when K divides T; 2d, 3d: K/q (``mode.local_kv_heads``,
                                  ``mode.kv_replication``)
context size, context mode       C = ``parallel.context`` ranks split every sequence (chunks i and
                                  2C − 1 − i, :mod:`gridshard.context`); :class:`ContextMode`
                                  (``ring`` | ``all_to_all``) says how attention crosses them
                                  (``mode.check_heads``: all_to_all needs C | local heads)
micro-batches per step            A = global_batch / (micro_batch·D) (:func:`micro_batches_per_step`)
stage → layers                    S = P·V stages, decoder layers split by :func:`stage_layer_counts`,
                                  stage s on pipeline rank s mod P (:class:`StageSplit`)
schedule, virtual stages, ZeRO    the config's values, kept with the rest (:class:`JobLayout`)
stage, recompute
================================  ============================================================

Who reads what: validation checks its rules with these functions; ``parallelize`` asks the
mesh's :class:`TensorMode` which layers to build and passes each layer the facts it needs
as constructor arguments (e.g. ``sequence_parallel`` already *in effect*): a layer never
needs to know the world or re-decide a fact. The pipeline builder and runner, the theory
(``gridshard.theory``) and the planner use :class:`StageSplit`, :func:`micro_batches_per_step`
and the :class:`TensorMode` methods; the trainer builds one :class:`JobLayout` from its config.

Default stage split (:func:`stage_layer_counts`): L/S decoder layers on every one of the S
stages, as Megatron splits them, the embedding on the first stage and the final norm and head
on the last. When S does not divide L the L mod S extra layers go to the middle stages first
(the end stages already carry the embedding and the head), then one to the first stage:
e.g. 126 layers on 16 stages are 7, 8 × 14, 7 (Llama 3 405B's split). ``parallel.stage_layers``
overrides it with explicit counts (the planner proposes some: docs/planner.md).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

from .errors import ConfigError, LayoutError
from .tensor_scheme import TensorMode


class ContextMode(str, Enum):
    """How attention crosses the C context ranks that split a sequence (``parallel.context_mode``):
    ``ring`` (k/v blocks travel around the ring, :mod:`gridshard.context.ring_attention`) or
    ``all_to_all`` (sequence traded for heads, :mod:`gridshard.context.all_to_all`). Compares
    equal to its config string."""

    RING = "ring"
    ALL_TO_ALL = "all_to_all"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value) -> "ContextMode":
        """The mode named by a config string (or a mode); LayoutError for an unknown name."""
        try:
            return cls(value)
        except ValueError:
            names = tuple(m.value for m in cls)
            raise LayoutError(f"context_mode={value!r} is unknown: it must be one of {names}. Fix: use 'ring' "
                              f"(any C) or 'all_to_all' (C divides the local heads).") from None

    def check_heads(self, local_heads: int, local_kv_heads: int, C: int) -> None:
        """LayoutError unless all_to_all can split this rank's heads over C: C divides the query
        heads (each context rank attends with H/C of them over the whole sequence), and the k/v
        heads are a multiple of C or divide it (:func:`traded_kv_heads`: then each is replicated)."""
        if self is not ContextMode.ALL_TO_ALL or C == 1:
            return
        if local_heads % C:
            raise LayoutError(f"context_mode='all_to_all' with context={C}: a rank's {local_heads} query heads (after "
                              f"the tensor split) are not divisible by C, and all_to_all gives each context rank 1/C "
                              f"of them. Fix: use context_mode='ring', or a context size among the divisors of "
                              f"{local_heads}.")
        if local_kv_heads % C and C % local_kv_heads:
            raise LayoutError(f"context_mode='all_to_all' with context={C}: a rank's {local_kv_heads} k/v heads (after "
                              f"the tensor split) neither split over C nor divide it (then each would be replicated "
                              f"C/{local_kv_heads} times). Fix: use context_mode='ring', or a context size that "
                              f"divides or is a multiple of {local_kv_heads}.")


def traded_kv_heads(kv_heads: int, C: int) -> int:
    """The k/v heads all_to_all context attention trades over C ranks: H_kv when C divides them,
    else C — each head replicated C/H_kv times (C a multiple of H_kv), so that each context rank gets
    one, the k/v head of its H/C query heads (as DeepSpeed's Ulysses does; :mod:`gridshard.context.all_to_all`)."""
    return kv_heads if C <= 1 or kv_heads % C == 0 else C


def check_context_sequence(seq_len: int, C: int, T: int = 1, sequence_parallel: bool = False) -> None:
    """LayoutError unless the context split fits the sequence: S divisible by 2·C (2C equal
    chunks, rank i holding chunks i and 2C − 1 − i), and under sequence parallelism (in effect)
    a rank's 2c = S/C tokens divisible by T (they are split again over the tensor group)."""
    if C == 1:
        return
    m = 2 * C
    if seq_len % m:
        lo, hi = max(m, seq_len // m * m), (seq_len // m + 1) * m
        raise LayoutError(f"seq_len={seq_len} with context={C}: the load-balanced context split cuts a sequence "
                          f"into 2·C = {m} equal chunks, so seq_len must be a multiple of {m}. Fix: use seq_len "
                          f"{lo} or {hi}, or a smaller context size.")
    if sequence_parallel and (seq_len // C) % T:
        raise LayoutError(f"seq_len={seq_len} with context={C} and sequence parallelism on tensor={T}: a context "
                          f"rank's {seq_len // C} tokens are split again into T blocks, so seq_len must be a "
                          f"multiple of C·T = {C * T} (and of 2·C). Fix: use a seq_len that is a multiple of "
                          f"{math.lcm(2 * C, C * T)}, or turn sequence_parallel off.")


def micro_batches_per_step(global_batch: int, micro_batch: int, data: int) -> int:
    """A = global_batch / (micro_batch·D): the micro-batches each data rank runs per step."""
    return global_batch // (micro_batch * data)


def stage_layer_counts(layers: int, stages: int, explicit: Optional[Sequence[int]] = None) -> list:
    """Decoder layers per stage (module docstring). ConfigError when a stage would get none
    or the explicit counts do not add up."""
    if explicit is not None:
        explicit = list(explicit)
        if len(explicit) != stages or sum(explicit) != layers or min(explicit) < 0:
            raise ConfigError(f"parallel.stage_layers={explicit} is invalid: it needs {stages} counts "
                              f"(pipeline × virtual_stages), each ≥ 0, adding up to model.layers={layers}. Fix: "
                              f"list {stages} layer counts that sum to {layers}, or remove it for an even split.")
        return explicit
    if layers < stages:
        raise ConfigError(f"parallel.pipeline × virtual_stages = {stages} stages but model.layers={layers}: every "
                          f"stage needs at least one decoder layer. Fix: use at most {layers} stages, or a deeper "
                          f"model.")
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    for s in (list(range(1, stages - 1)) + [0])[:extra]:    # extra < stages: the last stage never gets one
        counts[s] += 1
    return counts


@dataclass(frozen=True)
class StageSplit:
    """Which decoder layers each of the S = P·V pipeline stages holds, and which stages each
    pipeline rank runs (stage s on rank s mod P). Stage 0 also holds the embedding, stage
    S−1 the final norm and the head."""

    counts: tuple
    pipeline: int

    @classmethod
    def of(cls, layers: int, pipeline: int, virtual_stages: int = 1,
           explicit: Optional[Sequence[int]] = None) -> "StageSplit":
        return cls(tuple(stage_layer_counts(layers, pipeline * virtual_stages, explicit)), pipeline)

    @property
    def stages(self) -> int:
        return len(self.counts)

    @property
    def virtual_stages(self) -> int:
        return self.stages // self.pipeline

    def layer_ids(self) -> list:
        """The global decoder-layer indices of every stage."""
        starts = itertools.accumulate(self.counts, initial=0)
        return [list(range(start, start + n)) for start, n in zip(starts, self.counts)]

    def stages_of_rank(self, pipeline_rank: int) -> list:
        """The stage indices pipeline rank r runs: r, r+P, …, r+(V−1)P."""
        return list(range(pipeline_rank, self.stages, self.pipeline))

    def rank_layer_ids(self, pipeline_rank: int) -> list:
        """The decoder layers pipeline rank r holds, over all its stages, in order."""
        ids = self.layer_ids()
        return [i for s in self.stages_of_rank(pipeline_rank) for i in ids[s]]

    def holds_first(self, pipeline_rank: int) -> bool:
        return 0 in self.stages_of_rank(pipeline_rank)

    def holds_last(self, pipeline_rank: int) -> bool:
        return (self.stages - 1) in self.stages_of_rank(pipeline_rank)


@dataclass(frozen=True)
class JobLayout:
    """Every layout fact of one job, derived once from a validated config (module docstring).
    Build with :meth:`from_config`; frozen."""

    data: int
    pipeline: int
    tensor: int
    mode: TensorMode
    sequence_parallel: bool          # in effect (requested ∧ 1d ∧ T > 1)
    global_batch: int
    micro_batch: int
    schedule: str
    split: StageSplit
    kv_heads: int
    zero: int
    recompute: str
    context: int = 1                 # C: ranks one sequence is split over
    context_mode: ContextMode = ContextMode.RING
    depth: int = 1                   # 2.5D: d depth layers (parallel.tensor_depth); 1 otherwise

    @classmethod
    def from_config(cls, cfg, model_cfg=None) -> "JobLayout":
        """The job layout of a :class:`gridshard.config.TrainConfig` (already validated);
        ``model_cfg``: its resolved model, if the caller has it."""
        p, t = cfg.parallel, cfg.train
        m = model_cfg if model_cfg is not None else cfg.model.resolve()
        mode = TensorMode.parse(p.tensor_mode)
        return cls(data=p.data, pipeline=p.pipeline, tensor=p.tensor, mode=mode,
                   sequence_parallel=mode.sequence_parallel_in_effect(p.sequence_parallel, p.tensor),
                   global_batch=t.global_batch, micro_batch=t.micro_batch, schedule=p.pipeline_schedule,
                   split=StageSplit.of(m.layers, p.pipeline, p.virtual_stages, p.stage_layers),
                   kv_heads=m.kv_heads, zero=t.zero, recompute=t.recompute, context=p.context,
                   context_mode=ContextMode.parse(p.context_mode), depth=p.tensor_depth)

    @property
    def world(self) -> int:
        return self.data * self.pipeline * self.context * self.tensor

    @property
    def layer_mode(self) -> TensorMode:
        """The mode one depth layer's model is built with (2d at 2.5d; else the mode itself)."""
        return self.mode.layer_layout(self.tensor, self.depth)[0]

    @property
    def layer_tensor(self) -> int:
        """The ranks one depth layer's model is split over (q² at 2.5d; else T)."""
        return self.mode.layer_layout(self.tensor, self.depth)[1]

    @property
    def q(self) -> Optional[int]:
        """The grid or cube side of one layer's tensor group (None without one)."""
        return self.layer_mode.side(self.layer_tensor)

    @property
    def virtual_stages(self) -> int:
        return self.split.virtual_stages

    @property
    def micro_batches(self) -> int:
        return micro_batches_per_step(self.global_batch, self.micro_batch, self.data)

    @property
    def kv_replication(self) -> int:
        return self.layer_mode.kv_replication(self.kv_heads, self.layer_tensor)


__all__ = ["TensorMode", "ContextMode", "check_context_sequence", "JobLayout", "StageSplit", "micro_batches_per_step",
           "stage_layer_counts"]
