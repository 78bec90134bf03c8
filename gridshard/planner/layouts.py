"""Layouts: what the planner enumerates, and which of them the config rules accept.

A :class:`Layout` is everything ``gridshard plan`` chooses: the ``parallel:`` section
(D, P, T, tensor mode, sequence parallelism, pipeline schedule, virtual stages) and the
``train:`` keys zero, recompute and micro_batch. :func:`enumerate_layouts` lists every
combination the device count allows:

* D·P·C·T = N over all ordered factorisations of N, C the context size (issue 25): the divisors
  of N up to ``max_context`` (``plan``: 8) with ``seq_len`` a multiple of 2·C (the load-balanced
  split); C > 1 in both context modes, ``ring`` and ``all_to_all`` (the config rules refuse
  all_to_all where C does not divide the rank's heads), and with a pipeline only under ``1f1b``
  (to keep the search small; every schedule is exact at C > 1: tests/test_context_training.py);
* T = 1: ``none``; T > 1: ``1d`` without and with sequence parallelism, ``2d`` when T
  is a perfect square, and ``2.5d`` with every depth d ≥ 2 for which T = q²·d with q ≥ 2
  (``tensor_depth`` d; issue 24). The config rules keep the 2.5D layouts whose model fits 2D's
  shape rules on one depth layer's q² ranks and whose micro_batch is a multiple of d·q, so the
  enumeration follows them as they change. A 2.5D layout is priced as what each rank runs,
  :meth:`Layout.layer_layout`; and ``3d`` when T = q³ with q ≥ 2 (``TensorMode.check_tensor_size``;
  issue 24), which the config rules keep when the model fits 3D's layout rules
  (:func:`gridshard.nn.shape_rules.layout_rules`) and the composition is built — sequence parallelism
  is never in effect there (``sequence_parallel_in_effect``), so only ``3d`` without it;
* ZeRO 0–3 when D > 1 (with D = 1 every stage holds the same bytes: only 0);
* recompute none / selective / full;
* micro_batch: every divisor of global_batch / D (up to ``max_micro_batch``, 16 by default);
* P > 1: ``gpipe``, ``1f1b``, and ``interleaved_1f1b`` and ``zero_bubble`` with V ∈ {2, 4} virtual
  stages (zero bubble's bubble and activations in flight: :mod:`gridshard.theory.pipeline`; ZeRO-3
  refuses it, a config rule);
* ``train.overlap_grad_reduce`` true and false (issue 23) exactly where it changes how ZeRO-2/3
  accumulate: ZeRO-2/3 with sharded accumulation (:func:`gridshard.theory.zero.sharded_accumulation`:
  D·C·d > 1, a schedule in ``SHARDED_ACCUMULATION_SCHEDULES``) under a pipeline (P > 1) with A > 1
  micro-batches. true reduce-scatters every micro-batch (A× the reduce-scatter calls, no whole
  gradient between micro-batches); false (label ``whole-grad``) accumulates whole gradients and
  reduces once per step. At P = 1 only true is enumerated, to keep the search small (there false
  would also stop the reduction hiding under the last backward).
* an MoE model (``model.experts`` n > 0; issue 38): the expert ranks E (``parallel.expert``) over every
  divisor of gcd(n, D·C·d) — the experts split evenly, the expert groups cut from the weight
  replicas — and the dispatcher, ``all_to_all`` at every E > 1 and ``all_gather`` where E ≤ k
  (:func:`expert_choices`; :mod:`.price_expert` prices them);
* the stage split: the default (``stage_layers`` None: L/S layers per stage,
  :func:`gridshard.job_layout.stage_layer_counts`); the search adds the explicit split with one
  layer moved off the last stage (:func:`lighter_end_splits`, which can lighten either end)
  where the head makes that stage the slowest (:func:`.search.split_variants`).

Validity is the config's own: :func:`layout_problem` applies
:mod:`gridshard.config.validate`'s rules to the input config with the layout written in,
and returns the rule's message (``None`` when valid). The data-source check reads files
and does not depend on the layout, so the per-layout rules run without it (``--write``
runs the full validation on the written file); ``tests/test_planner.py`` checks that the
verdicts equal a full :func:`gridshard.config.validate.validate_config` on sampled layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from ..config import validate as rules
from ..config.schema import TrainConfig
from ..errors import ConfigError, LayoutError
from ..job_layout import TensorMode, stage_layer_counts
from ..tensor_scheme import tensor_schemes
from ..theory.zero import sharded_accumulation

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
VIRTUAL_STAGES = (2, 4)


@dataclass(frozen=True)
class Layout:
    """One candidate: ``tensor_mode`` is the config string (as written out); decisions read
    :attr:`mode`."""

    data: int
    pipeline: int
    tensor: int
    tensor_mode: str
    sequence_parallel: bool
    zero: int
    recompute: str
    micro_batch: int
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: Optional[tuple] = None        # explicit decoder layers per stage; None: the default split
    context: int = 1                            # C: ranks one sequence is split over
    context_mode: str = "ring"                  # ring | all_to_all (C > 1)
    tensor_depth: int = 1                       # d: 2.5D depth layers (T = q²·d); 1 otherwise
    overlap_grad_reduce: bool = True            # train.overlap_grad_reduce (false: whole-gradient accumulation)
    expert: int = 1                             # E: an MoE model's expert ranks (divides D·C)
    expert_dispatch: str = "all_to_all"         # all_to_all | all_gather (E > 1)

    @property
    def mode(self) -> TensorMode:
        return TensorMode.parse(self.tensor_mode)

    @property
    def layer_tensor(self) -> int:
        """Ranks of one tensor group's layer: q² at 2.5D, else T."""
        return self.mode.layer_layout(self.tensor, self.tensor_depth)[1]

    def layer_layout(self) -> "Layout":
        """The layout each rank runs, which the memory model and the step-time pricing read: at
        2.5D (d depth layers of a q×q grid) depth layer k is a complete 2D grid on batch slice k with
        the same weights (docs/tp2p5d.md), so a rank is a 2D rank on q² ranks with m/d rows per
        micro-batch among D·d data replicas — the same A = B/(m·D) micro-batches, and the reducer's
        and ZeRO's group data × context × depth of D·C·d ranks; every other layout is itself.
        (:meth:`gridshard.tensor_scheme.TensorScheme.layer_layout` is the rule.)"""
        mode, T = self.mode.layer_layout(self.tensor, self.tensor_depth)
        if mode is self.mode:
            return self
        d = self.tensor_depth
        return replace(self, data=self.data * d, tensor=T, tensor_mode=str(mode), micro_batch=self.micro_batch // d,
                       tensor_depth=1)

    def parallel_section(self) -> dict:
        """The ``parallel:`` keys (``stage_layers`` None for the default split), every one of them, so
        that none of the input config's own values survives into a candidate (its ``expert``, say)."""
        return {"data": self.data, "pipeline": self.pipeline, "context": self.context,
                "context_mode": self.context_mode, "tensor": self.tensor,
                "tensor_mode": self.tensor_mode, "tensor_depth": self.tensor_depth,
                "sequence_parallel": self.sequence_parallel, "pipeline_schedule": self.pipeline_schedule,
                "virtual_stages": self.virtual_stages,
                "stage_layers": None if self.stage_layers is None else list(self.stage_layers),
                "expert": self.expert, "expert_dispatch": self.expert_dispatch}

    def train_section(self) -> dict:
        return {"zero": self.zero, "recompute": self.recompute, "micro_batch": self.micro_batch,
                "overlap_grad_reduce": self.overlap_grad_reduce}

    def label(self) -> str:
        mode = self.tensor_mode + ("+SP" if self.sequence_parallel else "") + \
            (f" d{self.tensor_depth}" if self.tensor_depth > 1 else "")
        pipe = f" {self.pipeline_schedule}" + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "") \
            if self.pipeline > 1 else ""
        split = "" if self.stage_layers is None else f" layers={split_label(self.stage_layers)}"
        ctx = f" C{self.context} {self.context_mode}" if self.context > 1 else ""
        ctx += f" E{self.expert} {self.expert_dispatch}" if self.expert > 1 else ""
        return (f"D{self.data} P{self.pipeline}{ctx} T{self.tensor} {mode}{pipe}{split} z{self.zero} "
                f"rc={self.recompute} m{self.micro_batch}" + ("" if self.overlap_grad_reduce else " whole-grad"))

    @property
    def world(self) -> int:
        return self.data * self.pipeline * self.context * self.tensor


def split_label(counts) -> str:
    """Layers per stage, runs of equal counts shortened: (7, 8, 8, 8, 7) → ``7,8×3,7``."""
    runs: list = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(str(n) if k == 1 else f"{n}×{k}" for n, k in runs)


def lighter_end_splits(layers: int, stages: int, off_first: bool, off_last: bool) -> list:
    """Explicit splits of ``layers`` over ``stages`` that move one decoder layer off the first
    stage (``off_first``), the last (``off_last``) or each of them, relative to the default
    :func:`~gridshard.job_layout.stage_layer_counts`: each moved layer goes to the stage with
    the fewest layers among the middle ones (the one nearest the middle on a tie), or with two
    stages to the other end. An end keeps at least one layer. Returns tuples, none equal to
    the default."""
    default = stage_layer_counts(layers, stages)
    if stages < 2:
        return []
    wanted = [(True, False)] * off_first + [(False, True)] * off_last + \
        [(True, True)] * (off_first and off_last and stages > 2)
    out = []
    for f, la in wanted:
        counts = list(default)
        for end, move in ((0, f), (stages - 1, la)):
            if not move or counts[end] <= 1:
                continue
            counts[end] -= 1
            takers = list(range(1, stages - 1)) or [stages - 1 - end]
            counts[min(takers, key=lambda i: (counts[i], abs(2 * i - (stages - 1))))] += 1
        if counts != default and tuple(counts) not in out:
            out.append(tuple(counts))
    return out


def divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def factorisations(n: int) -> list:
    """Every (D, P, T) with D·P·T = n."""
    return [(d, p, n // d // p) for d in divisors(n) for p in divisors(n // d)]


def _modes(T: int) -> list:
    """(tensor_mode string, sequence_parallel, tensor_depth) triples for T ranks: the modes whose size
    rule T meets (a mode that splits weights only when T > 1), 1d also with sequence parallelism,
    2.5d once per depth d ≥ 2 with T = q²·d, q ≥ 2 (d = 1 is 2d)."""
    out = []
    for mode in tensor_schemes():
        for depth in mode.depth_choices(T):
            try:
                mode.check_tensor_size(T, depth)
            except LayoutError:
                continue
            if mode.plannable(T):
                out += [(str(mode), sp, depth) for sp in (False, True)
                        if not sp or mode.sequence_parallel_in_effect(sp, T)]
    return out


def _schedules(P: int, C: int = 1) -> list:
    if P == 1 or C > 1:
        return [("1f1b", 1)]
    return [("gpipe", 1), ("1f1b", 1)] + [(s, v) for s in ("interleaved_1f1b", "zero_bubble") for v in VIRTUAL_STAGES]


def contexts(world: int, seq_len: Optional[int], max_context: int = 8) -> list:
    """(C, context_mode) pairs to try (module docstring): C = 1, and each divisor C > 1 of ``world``
    up to ``max_context`` that splits ``seq_len`` into 2·C equal chunks, in both modes."""
    sizes = [c for c in divisors(world) if 1 < c <= max_context and (seq_len is None or seq_len % (2 * c) == 0)]
    return [(1, "ring")] + [(c, m) for c in sizes for m in ("ring", "all_to_all")]


def enumerate_layouts(world: int, global_batch: int, zero_stages=(0, 1, 2, 3), recompute=RECOMPUTE,
                      micro_batches: Optional[list] = None, max_micro_batch: Optional[int] = None,
                      seq_len: Optional[int] = None, max_context: int = 1, experts: int = 0,
                      experts_per_token: int = 1) -> Iterator[Layout]:
    """Every candidate layout of ``world`` ranks (module docstring), valid or not; micro-batches
    ``micro_batches`` if given, else the divisors of global_batch/D up to ``max_micro_batch``;
    context sizes up to ``max_context`` (1: none) that split ``seq_len``; an MoE model's
    (``experts`` > 0, k = ``experts_per_token``) expert sizes and dispatchers (:func:`expert_choices`)."""
    for C, cmode in contexts(world, seq_len, max_context):
        for layout in _enumerate_dpt(world // C, global_batch, zero_stages, recompute, micro_batches,
                                     max_micro_batch, C):
            layout = layout if C == 1 else replace(layout, context=C, context_mode=cmode)
            if not experts:
                yield layout
                continue
            for E, dispatch in expert_choices(layout.data * C * layout.tensor_depth, experts, experts_per_token):
                yield replace(layout, expert=E, expert_dispatch=dispatch)


def expert_choices(replicas: int, experts: int, top_k: int) -> list:
    """(E, dispatcher) pairs of an MoE model (module docstring): every E dividing both ``experts``
    and the R = D·C·d weight-replica ranks it is cut from; at E > 1 ``all_to_all``, and
    ``all_gather`` too where E ≤ k: under balanced routing it moves (E − 1)·N rows of h where the
    all-to-all moves (E − 1)·N·k/E (:func:`gridshard.theory.moe.dispatch_volume`), more bytes in
    more calls once E > k, so there it never wins."""
    out = [(1, "all_to_all")]
    for E in divisors(math.gcd(replicas, experts))[1:]:
        out += [(E, "all_to_all")] + ([(E, "all_gather")] if E <= top_k else [])
    return out


def _enumerate_dpt(world: int, global_batch: int, zero_stages, recompute, micro_batches, max_micro_batch,
                   C: int) -> Iterator[Layout]:
    """The D·P·T = ``world`` layouts of one context size C (:func:`enumerate_layouts`)."""
    for D, P, T in factorisations(world):
        mbs = [m for m in divisors(global_batch // D) if m <= (max_micro_batch or m)] if micro_batches is None \
            else list(micro_batches)
        if global_batch % D:
            mbs = [1]            # kept so that the batch rule names the reason
        for mode, sp, depth in _modes(T):
            for sched, V in _schedules(P, C):
                for m in mbs:
                    for z in (zero_stages if D * C > 1 else (0,)):      # ZeRO shards over D·C
                        for rc in recompute:
                            for ov in overlap_choices(z, D * C * depth, P, sched, global_batch // (m * D)):
                                yield Layout(D, P, T, mode, sp, z, rc, m, sched, V, tensor_depth=depth,
                                             overlap_grad_reduce=ov)


def overlap_choices(zero: int, data_ranks: int, P: int, schedule: str, A: int) -> tuple:
    """``train.overlap_grad_reduce`` values to enumerate (module docstring): (True, False) where the
    flag decides sharded vs whole-gradient accumulation under a pipeline with A > 1, else (True,)."""
    return (True, False) if P > 1 and A > 1 and sharded_accumulation(zero, data_ranks, P, schedule) else (True,)


def apply_layout(cfg: TrainConfig, layout: Layout) -> TrainConfig:
    """``cfg`` with the layout's parallel section and train keys written in (nothing else changes)."""
    parallel = cfg.parallel.model_copy(update=layout.parallel_section())
    train = cfg.train.model_copy(update=layout.train_section())
    return cfg.model_copy(update={"parallel": parallel, "train": train})


def layout_problem(cfg: TrainConfig, layout: Layout, world: int, cuda_available: bool = False) -> Optional[str]:
    """The config rule ``layout`` breaks (its message), or None. Same order as
    :func:`gridshard.config.validate.validate_config`, the data check excepted (module docstring)."""
    try:
        rules.validate_config(apply_layout(cfg, layout), world, cuda_available, check_data=False)
    except ConfigError as e:
        return str(e)
    return None


__all__ = ["Layout", "enumerate_layouts", "expert_choices", "contexts", "factorisations", "divisors", "apply_layout",
           "layout_problem", "lighter_end_splits", "split_label", "overlap_choices", "RECOMPUTE", "SCHEDULES"]
