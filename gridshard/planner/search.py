"""``gridshard.plan``: enumerate, check, price and rank every layout of a config on N devices.

For each candidate :class:`~gridshard.planner.layouts.Layout`:

1. the config's own rules (:func:`~gridshard.planner.layouts.layout_problem`) — a broken
   rule rejects it with that rule's message;
2. memory (:func:`~gridshard.planner.cost_memory.layout_memory`, the worst rank of
   :func:`gridshard.theory.memory.predict_rank_memory`): rejected when the predicted peak
   plus the safety margin exceeds the device memory;
3. step time (:func:`~gridshard.planner.cost_time.node_step`: the slowest pipeline rank's
   critical path, or on an over-subscribed node the throughput bound over every pipeline rank).

Feasible layouts are ranked by predicted step time (ties: less memory). When none is
feasible, :class:`PlanError` says why and names the nearest feasible alternative (another
device count, or the smallest-memory layout and what it lacks).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

from ..config import load_config
from ..errors import ConfigError
from ..theory.memory import activation_bytes
from ..theory.training import flops_per_token, mfu
from .cost_memory import layout_memory, ranks_to_check, stage_layers_of_rank
from .cost_time import StepTime, node_step, rank_cost
from .hardware import Hardware, load_hardware
from .layouts import Layout, apply_layout, enumerate_layouts, layout_problem


class PlanError(ConfigError):
    """No layout is feasible; the message names the nearest feasible alternative."""


@dataclass
class Candidate:
    layout: Layout
    feasible: bool
    reason: str = ""                       # why not feasible ("" when feasible)
    memory: object = None                  # RankMemory of the worst rank (None when a rule failed)
    memory_rank: int = 0
    step: Optional[StepTime] = None
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    peak_flops: float = 0.0
    world: int = 1

    @property
    def predicted_mem_bytes(self) -> Optional[int]:
        return None if self.memory is None else int(self.memory.total_with_margin)

    @property
    def predicted_step_s(self) -> Optional[float]:
        return None if self.step is None else self.step.total_s

    @property
    def tokens_per_s(self) -> Optional[float]:
        return None if self.step is None else self.tokens_per_step / self.step.total_s

    @property
    def mfu(self) -> Optional[float]:
        return None if self.step is None else mfu(self.flops_per_token, self.tokens_per_s, self.peak_flops, self.world)

    def as_json(self) -> dict:
        """The ``--json`` record (issue 13's interface: parallel, train, predicted_mem_bytes,
        predicted_step_s, predicted_tokens_per_s, feasible, reason; plus the splits)."""
        mem = None if self.memory is None else {
            "params": self.memory.params, "grads": self.memory.grads, "optimizer": self.memory.optimizer,
            "activations": self.memory.activations, "buffers": self.memory.comm_buffers + self.memory.transient,
            "baseline": self.memory.baseline, "margin": self.memory.margin, "total": self.memory.total,
            "total_with_margin": self.memory.total_with_margin, "margin_fraction": self.memory.margin_fraction,
            "pipeline_rank": self.memory_rank}
        return {"label": self.layout.label(), "parallel": self.layout.parallel_section(),
                "train": self.layout.train_section(), "predicted_mem_bytes": self.predicted_mem_bytes,
                "predicted_step_s": self.predicted_step_s, "predicted_tokens_per_s": self.tokens_per_s,
                "predicted_mfu": self.mfu, "feasible": self.feasible, "reason": self.reason or None,
                "memory": mem, "step": None if self.step is None else self.step.as_dict()}


@dataclass
class PlanResult:
    candidates: list                       # feasible ones, best first
    rejected: list                         # infeasible ones (rule or memory)
    config: object                         # the input TrainConfig
    hardware: Hardware
    world: int
    nodes: int
    source: object = None
    overrides: tuple = ()
    counts: dict = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def _precision(cfg) -> str:
    return cfg.train.precision if cfg.train.precision in ("bf16", "fp16") else "fp32"


def evaluate(cfg, layout: Layout, hw: Hardware, world: int, nodes: int = 1, stop_agreement: bool = False) -> Candidate:
    """Rules, memory and step time of one layout of ``cfg`` (module docstring);
    ``stop_agreement``: the run has a stop handler installed (cost_time's trainer bookkeeping)."""
    mc, s, G = cfg.model.resolve(), cfg.data.seq_len, cfg.train.global_batch
    prec = _precision(cfg)
    cand = Candidate(layout, False, tokens_per_step=G * s, world=world,
                     flops_per_token=flops_per_token(mc.vocab_size, mc.hidden, mc.layers, mc.ffn_hidden, s,
                                                     mc.kv_heads * mc.head_dim),
                     peak_flops=hw.peak_flops.get(prec) or hw.peak_flops["fp32"])
    problem = layout_problem(cfg, layout, world)
    if problem:
        cand.reason = problem
        return cand
    cand.memory, cand.memory_rank = layout_memory(mc, layout, s, G, hw.reserved_bytes, hw.margin_fraction)
    if cand.memory.total_with_margin > hw.device_memory_bytes:
        cand.reason = (f"memory: {gib(cand.memory.total_with_margin)} per rank (with the "
                       f"{cand.memory.margin_fraction:.0%} margin) > {gib(hw.device_memory_bytes)} on {hw.name}")
        return cand                        # not priced: it cannot run
    P, V = layout.pipeline, layout.virtual_stages
    per_rank = stage_layers_of_rank(mc.layers, P, V) if P > 1 else [None]
    ranks_per_node = max(1, world // max(1, nodes))
    # the critical path needs the slowest rank only; the throughput bound the mean of them all
    check = range(P) if hw.oversubscribed(ranks_per_node) else (ranks_to_check(per_rank) if P > 1 else [0])
    costs, seen = [], {}
    for r in check:
        ids, first, last = per_rank[r], r == 0, r == P - 1
        key = (None if ids is None else len(ids), first, last)      # decoder layers are alike: the count matters
        if key not in seen:
            # the element-wise work of a forward and backward: what the layers write without
            # recompute (recompute changes what is kept, not what is computed; rank_cost adds its pass)
            acts = activation_bytes(mc, layout.micro_batch, s, layout.tensor_mode, layout.tensor,
                                    layout.sequence_parallel, "none", key[0], first, last).total
            seen[key] = rank_cost(mc, layout, hw, seq_len=s, global_batch=G, precision=prec, nodes=nodes,
                                  layer_ids=ids, first=first, last=last, activation_bytes=acts,
                                  bucket_mb=cfg.train.bucket_mb, stop_agreement=stop_agreement,
                                  log_interval=cfg.train.log_interval)
        costs.append(seen[key])
    cand.step = node_step(costs, hw, ranks_per_node)
    cand.feasible = True
    return cand


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _sort_key(c: Candidate):
    return (c.predicted_step_s, c.predicted_mem_bytes, c.layout.label())


def plan(config=None, gpus: Optional[int] = None, *, nodes: int = 1, hardware="cpu", overrides=(),
         top: Optional[int] = None, zero_stages=(0, 1, 2, 3), max_micro_batch: int = 16,
         raise_if_none: bool = True) -> PlanResult:
    """Plan ``config`` (YAML path, dict, TrainConfig or None) on ``gpus`` devices over ``nodes`` nodes.

    ``hardware``: a packaged name (h100, h200, a100, cpu), a profile path, or a Hardware.
    ``max_micro_batch``: largest micro-batch tried (all divisors of global_batch/D up to it).
    Returns a :class:`PlanResult` (feasible candidates best first, ``top`` of them if given);
    raises :class:`PlanError` when none is feasible (``raise_if_none``)."""
    cfg = load_config(config, overrides)
    world = cfg.world_size if gpus is None else int(gpus)
    if world < 1 or nodes < 1 or world % nodes:
        raise ConfigError(f"--gpus {world} --nodes {nodes} is invalid: the devices must split evenly over the "
                          f"nodes. Fix: give a multiple of --nodes.")
    hw = load_hardware(hardware)
    if cfg.model.hf_config is not None:
        raise ConfigError("model.hf_config: the planner's memory and communication formulas describe gridshard's "
                          "own model. Fix: plan with the equivalent explicit model.* fields.")
    feasible, rejected = [], []
    counts = collections.Counter()
    for layout in enumerate_layouts(world, cfg.train.global_batch, zero_stages=zero_stages,
                                    max_micro_batch=max_micro_batch):
        c = evaluate(cfg, layout, hw, world, nodes)
        (feasible if c.feasible else rejected).append(c)
        counts["feasible" if c.feasible else ("memory" if c.memory is not None else "rule")] += 1
    feasible.sort(key=_sort_key)
    result = PlanResult(feasible[:top] if top else feasible, rejected, cfg, hw, world, nodes, config,
                        tuple(overrides), dict(counts))
    if not feasible and raise_if_none:
        raise PlanError(no_layout_message(result))
    return result


def no_layout_message(result: PlanResult) -> str:
    """Why nothing is feasible, and the nearest feasible alternative."""
    cfg, hw, N = result.config, result.hardware, result.world
    by_memory = [c for c in result.rejected if c.memory is not None]
    if by_memory:
        smallest = min(by_memory, key=lambda c: c.predicted_mem_bytes)
        alt = _nearest_device_count(cfg, hw, N, result.nodes, upward=True)
        msg = (f"no layout of {N} × {hw.name} fits: the smallest, {smallest.layout.label()}, needs "
               f"{gib(smallest.predicted_mem_bytes)} per rank (params {gib(smallest.memory.params)}, grads "
               f"{gib(smallest.memory.grads)}, optimizer {gib(smallest.memory.optimizer)}, activations "
               f"{gib(smallest.memory.activations)}, margin {smallest.memory.margin_fraction:.0%}) against "
               f"{gib(hw.device_memory_bytes)}.")
        if alt:
            msg += f" Nearest feasible: --gpus {alt[0]} with {alt[1].layout.label()} ({gib(alt[1].predicted_mem_bytes)})."
        else:
            msg += " Fix: more devices, a shorter data.seq_len or a smaller model."
        return msg
    reasons = collections.Counter(c.reason.split(" Fix:")[0] for c in result.rejected)
    common = reasons.most_common(1)[0][0].rstrip(". ") if reasons else "no candidate"
    alt = _nearest_device_count(cfg, hw, N, result.nodes, upward=None)
    msg = f"no layout of {N} devices passes the config rules; the most common reason: {common}."
    if alt:
        msg += f" Nearest feasible: --gpus {alt[0]} with {alt[1].layout.label()}."
    return msg


def _nearest_device_count(cfg, hw, N: int, nodes: int, upward) -> Optional[tuple]:
    """(device count, its best candidate) nearest to N with a feasible layout; searched over the
    lightest settings only (ZeRO-3 or 0, full recompute, micro-batch 1) to stay quick."""
    if upward:
        tries = [N * k for k in (2, 4, 8, 16, 32, 64)]
    else:
        tries = [n for d in range(1, N + 1) for n in (N - d, N + d) if n >= 1][:16]
    for n in tries:
        if n % nodes:
            continue
        best = None
        for layout in enumerate_layouts(n, cfg.train.global_batch, zero_stages=(3,),
                                        recompute=("full",), micro_batches=[1]):
            c = evaluate(cfg, layout, hw, n, nodes)
            if c.feasible and (best is None or _sort_key(c) < _sort_key(best)):
                best = c
        if best is None:
            for layout in enumerate_layouts(n, cfg.train.global_batch, zero_stages=(0,)):
                c = evaluate(cfg, layout, hw, n, nodes)
                if c.feasible:
                    best = c
                    break
        if best is not None:
            return n, best
    return None


__all__ = ["plan", "evaluate", "PlanResult", "Candidate", "PlanError", "apply_layout"]
