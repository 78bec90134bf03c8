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

Stage splits: every pipeline layout is first priced with the default split (L/S layers per
stage, :func:`gridshard.job_layout.stage_layer_counts`). When its step is decided by the
critical path, the slowest pipeline rank holds the last stage and the head outweighs a decoder
layer (:func:`split_variants`; the embedding, a lookup, never outweighs one, so by time the
first stage is never the one to lighten), the layout with one layer moved off the last stage
(:func:`~gridshard.planner.layouts.lighter_end_splits`) is priced too, and ranked with the
rest when it fits and is faster than the default split; ``--write`` then writes its
``parallel.stage_layers``.

Nodes: without ``nodes`` the N devices go on ⌈N / devices_per_node⌉ nodes of the hardware
(the fewest nodes that split N evenly with at most ``devices_per_node`` each,
:func:`default_nodes`). The request is checked before anything is priced
(:func:`check_request`): N, nodes and ``top`` ≥ 1, nodes dividing N, at most
``devices_per_node`` devices per node, and the config's own positivity rules (batch sizes).
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..config import load_config
from ..config import validate as rules
from ..errors import ConfigError
from ..theory.memory import activation_bytes
from ..theory.training import mfu, model_flops_per_token
from .cost_memory import layout_memory, ranks_to_check, stage_layers_of_rank
from .cost_time import StepTime, node_step, rank_cost
from .hardware import Hardware, load_hardware
from .layouts import Layout, apply_layout, enumerate_layouts, expert_choices, layout_problem, lighter_end_splits
from .price_compute import microbatch_flops
from .price_expert import moe_layer_count


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
    rank_step_s: dict = field(default_factory=dict)   # pipeline rank → its critical path (the ranks priced)
    rank_busy: dict = field(default_factory=dict)     # pipeline rank → its busy StepTime, uncontended (emulate)

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
    nodes_note: str = ""                   # how the node count was chosen (--explain)
    nodes_given: bool = False              # the caller chose the node count
    max_context: int = 8                   # the largest C searched (the nearest alternative's too)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def evaluate(cfg, layout: Layout, hw: Hardware, world: int, nodes: int = 1, stop_agreement: bool = False,
             price_too_large: bool = False) -> Candidate:
    """Rules, memory and step time of one layout of ``cfg`` (module docstring);
    ``stop_agreement``: the run has a stop handler installed (cost_time's trainer bookkeeping);
    ``price_too_large``: price a layout that does not fit too (it stays infeasible, with its
    reason), e.g. to compare a published layout's step time whatever the memory model says."""
    mc, s, G = cfg.model.resolve(), cfg.data.seq_len, cfg.train.global_batch
    prec = cfg.train.precision if cfg.train.precision in ("bf16", "fp16") else "fp32"
    cand = Candidate(layout, False, tokens_per_step=G * s, world=world,
                     flops_per_token=model_flops_per_token(cfg.model.kind, mc, s),
                     peak_flops=hw.peak_flops.get(prec) or hw.peak_flops["fp32"])
    cand.reason = layout_problem(cfg, layout, world) or ""
    if cand.reason:
        return cand
    cand.memory, cand.memory_rank = layout_memory(mc, layout, s, G, hw.reserved_bytes, hw.margin_fraction, prec,
                                                  cfg.data.document_mask)
    if cand.memory.total_with_margin > hw.device_memory_bytes:
        cand.reason = (f"memory: {gib(cand.memory.total_with_margin)} per rank (with the "
                       f"{cand.memory.margin_fraction:.0%} margin) > {gib(hw.device_memory_bytes)} on {hw.name}")
        if not price_too_large:
            return cand                    # not priced: it cannot run
    P, V = layout.pipeline, layout.virtual_stages
    per_rank = stage_layers_of_rank(mc.layers, P, V, layout.stage_layers) if P > 1 else [None]
    ranks_per_node = max(1, world // max(1, nodes))
    # the critical path needs the slowest rank only; the throughput bound the mean of them all
    check = range(P) if hw.oversubscribed(ranks_per_node) else (ranks_to_check(per_rank) if P > 1 else [0])
    costs, seen = [], {}
    for r in check:
        ids, first, last = per_rank[r], r == 0, r == P - 1
        # decoder layers are alike: the counts (all, MoE) matter
        key = (None if ids is None else len(ids), first, last, moe_layer_count(mc, ids))
        if key not in seen:
            # the element-wise work of a forward and backward: what the layers write without
            # recompute (recompute changes what is kept, not what is computed; rank_cost adds its pass)
            run = layout.layer_layout()          # 2.5D: the 2D layout each rank runs (m/d rows, q² ranks)
            acts = activation_bytes(mc, run.micro_batch, s, run.tensor_mode, run.tensor,
                                    run.sequence_parallel, "none", key[0], first, last,
                                    precision=prec, context=run.context, moe_layers=key[3], expert=run.expert,
                                    context_mode=run.context_mode).total
            seen[key] = rank_cost(mc, layout, hw, seq_len=s, global_batch=G, precision=prec, nodes=nodes,
                                  layer_ids=ids, first=first, last=last, activation_bytes=acts,
                                  bucket_mb=cfg.train.bucket_mb, stop_agreement=stop_agreement,
                                  log_interval=cfg.train.log_interval)
        costs.append(seen[key])
    cand.rank_step_s = {r: c.latency.total_s for r, c in zip(check, costs)}
    cand.rank_busy = {r: c.busy for r, c in zip(check, costs)}
    cand.step = node_step(costs, hw, ranks_per_node)
    cand.feasible = not cand.reason
    return cand


def expert_family(cfg, base: Layout, hw: Hardware, world: int, nodes: int, mc) -> tuple:
    """(candidates, (why, count) of the variants not evaluated) of one layout without experts: itself
    for a dense model; for an MoE model every (E, dispatcher) of :func:`~.layouts.expert_choices`.
    Two shortcuts keep a 1024-device search to minutes: the config rules are read at E = 1 (the rules
    on E hold by construction, the others do not read it), and when neither E = 1 nor the largest E
    all-to-all fits, no other E is priced (the expert state falls as 1/E and nothing else changes
    with E > 1 — an all-gather's buffers hold more — so every other E > 1 needs at least as much)."""
    if not getattr(mc, "experts", 0):
        return [evaluate(cfg, base, hw, world, nodes)], ("rule", 0)
    choices = expert_choices(base.data * base.context * base.tensor_depth, mc.experts, mc.experts_per_token)
    first = evaluate(cfg, base, hw, world, nodes)
    if first.memory is None or len(choices) == 1:
        return [first], ("rule", len(choices) - 1)
    largest = (max(E for E, _ in choices), "all_to_all")
    last = evaluate(cfg, dataclasses.replace(base, expert=largest[0]), hw, world, nodes)
    if not first.feasible and not last.feasible and last.memory is not None:
        return [first, last], ("memory", len(choices) - 2)
    return [first, last] + [evaluate(cfg, dataclasses.replace(base, expert=E, expert_dispatch=d), hw, world, nodes)
                            for E, d in choices[1:] if (E, d) != largest], ("memory", 0)


def expert_keys(mc) -> dict:
    """:func:`~.layouts.enumerate_layouts`'s MoE arguments of a model (none for a dense one)."""
    experts = getattr(mc, "experts", 0)
    return {"experts": experts, "experts_per_token": mc.experts_per_token} if experts else {}


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _sort_key(c: Candidate):
    return (c.predicted_step_s, c.predicted_mem_bytes, c.layout.label())


def default_nodes(world: int, hw: Hardware) -> tuple:
    """(nodes, how they were chosen) for ``world`` devices when no node count is given:
    ⌈world / devices_per_node⌉, or the next count that divides ``world`` (every node holds the
    same number of devices) when that one does not."""
    per, name = hw.devices_per_node, hw.name
    need = -(-world // per)
    nodes = next(k for k in range(need, world + 1) if world % k == 0)
    if nodes == need:
        return nodes, f"nodes: {nodes} = ⌈{world} / {per} devices per node of {name}⌉ (--nodes not given)"
    return nodes, (f"nodes: {nodes} of {world // nodes} device(s) each, the fewest that split {world} evenly with at "
                   f"most {per} devices per node of {name} (⌈{world} / {per}⌉ = {need} does not divide {world}; "
                   f"--nodes not given)")


def check_top(top: Optional[int]) -> None:
    """ConfigError unless ``top`` (the rows shown) is None or ≥ 1."""
    if top is not None and top < 1:
        raise ConfigError(f"--top {top} is invalid: it is the number of layouts shown and must be at least 1. "
                          f"Fix: --top 10 (the default), or any K ≥ 1.")


def check_request(world: int, nodes: Optional[int], hw: Hardware) -> None:
    """ConfigError naming the value, the rule and a fix when ``world`` devices on ``nodes``
    nodes (None: :func:`default_nodes`) cannot be planned (module docstring)."""
    if world < 1:
        raise ConfigError(f"--gpus {world} is invalid: a plan needs at least 1 device. Fix: --gpus N with N ≥ 1, or "
                          f"omit --gpus to plan the config's own parallel.data × pipeline × tensor.")
    if nodes is None:
        return
    fix = f"Fix: --nodes {default_nodes(world, hw)[0]} (⌈{world} / {hw.devices_per_node} devices per node of " \
          f"{hw.name}⌉), or omit --nodes."
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes} is invalid: the devices need at least 1 node. {fix}")
    if nodes > world:
        raise ConfigError(f"--nodes {nodes} is more than --gpus {world}: every node needs at least one device. {fix}")
    if world % nodes:
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        raise ConfigError(f"--nodes {nodes} does not divide --gpus {world}: every node holds the same number of "
                          f"devices. Fix: --nodes one of {', '.join(map(str, divisors[:12]))}"
                          f"{', …' if len(divisors) > 12 else ''}, or omit --nodes.")
    if world // nodes > hw.devices_per_node:
        raise ConfigError(f"--gpus {world} on --nodes {nodes} puts {world // nodes} devices on a node, but a "
                          f"{hw.name} node has {hw.devices_per_node} (devices_per_node in its hardware file): links "
                          f"between them would be priced as inside a node. {fix[:-1]}, or a hardware file with "
                          f"devices_per_node ≥ {world // nodes}.")


def split_variants(cand: Candidate, model_cfg, seq_len: int) -> list:
    """Layouts with one layer moved off the slowest end stage(s) of ``cand`` (module docstring):
    only for a priced pipeline layout on the default split whose step is its critical path,
    whose slowest rank holds the first or the last stage, and whose end stage carries more
    work than a decoder layer — which only the head can (the head's F_head = 6·V·h per token
    against a layer's FLOPs, recompute included; the embedding is a lookup, no FLOPs): moving a
    layer gives another stage one more, so a lighter end cannot gain, and pricing it is skipped."""
    lay, P = cand.layout, cand.layout.pipeline
    if not cand.feasible or P < 2 or lay.stage_layers is not None or cand.step.details.get("regime") != "latency":
        return []
    slowest = max(cand.rank_step_s.values())
    slow = {r for r, t in cand.rank_step_s.items() if t >= slowest * (1 - 1e-9)}
    last_layer_moe = moe_layer_count(model_cfg, [model_cfg.layers - 1])
    head_outweighs_a_layer = (microbatch_flops(model_cfg, lay, seq_len, 0, True)
                              > microbatch_flops(model_cfg, lay, seq_len, 1, False, last_layer_moe))
    off_last = P - 1 in slow and head_outweighs_a_layer
    splits = lighter_end_splits(model_cfg.layers, P * lay.virtual_stages, False, off_last)
    return [dataclasses.replace(lay, stage_layers=counts) for counts in splits]


def plan(config=None, gpus: Optional[int] = None, *, nodes: Optional[int] = None, hardware="cpu", overrides=(),
         top: Optional[int] = None, zero_stages=(0, 1, 2, 3), max_micro_batch: int = 16,
         raise_if_none: bool = True, max_context: int = 8) -> PlanResult:
    """Plan ``config`` (YAML path, dict, TrainConfig or None) on ``gpus`` devices over ``nodes`` nodes
    (default: :func:`default_nodes` of the hardware).

    ``hardware``: a packaged name (h100, h200, a100, cpu), a profile path, or a Hardware.
    ``max_micro_batch``: largest micro-batch tried (all divisors of global_batch/D up to it);
    ``max_context``: largest context size C tried (1: no context parallelism).
    Returns a :class:`PlanResult` (feasible candidates best first, ``top`` of them if given);
    raises :class:`PlanError` when none is feasible (``raise_if_none``), ConfigError for a
    request that cannot be planned (:func:`check_request`)."""
    cfg = load_config(config, overrides)
    rules._positive(cfg)                   # batch sizes, seq_len, model sizes ≥ 1: the config's own rule
    world = cfg.world_size if gpus is None else int(gpus)
    hw = load_hardware(hardware)
    check_top(top)
    check_request(world, nodes, hw)
    note = f"nodes: {nodes} (--nodes)"
    if nodes is None:
        nodes, note = default_nodes(world, hw)
    if cfg.model.unmodelled() is not None:
        raise ConfigError(f"the planner's memory and communication formulas do not describe "
                          f"{cfg.model.unmodelled()}. Fix: choose this model's layout by hand; `gridshard train` "
                          f"still checks it before launch.")
    feasible, rejected, counts = [], [], collections.Counter()
    mc = cfg.model.resolve()
    for base in enumerate_layouts(world, cfg.train.global_batch, zero_stages=zero_stages,
                                  max_micro_batch=max_micro_batch, seq_len=cfg.data.seq_len, max_context=max_context):
        family, skipped = expert_family(cfg, base, hw, world, nodes, mc)
        counts[skipped[0]] += skipped[1]
        for c in family:
            variants = (evaluate(cfg, x, hw, world, nodes) for x in split_variants(c, mc, cfg.data.seq_len))
            faster = [v for v in variants if v.feasible and v.predicted_step_s < c.predicted_step_s]
            for x in [c] + faster:
                (feasible if x.feasible else rejected).append(x)
                counts["feasible" if x.feasible else ("memory" if x.memory is not None else "rule")] += 1
    feasible.sort(key=_sort_key)
    result = PlanResult(feasible[:top] if top else feasible, rejected, cfg, hw, world, nodes, config,
                        tuple(overrides), dict(counts), note, note.endswith("(--nodes)"), max_context)
    if not feasible and raise_if_none:
        raise PlanError(no_layout_message(result))
    return result


def no_layout_message(result: PlanResult) -> str:
    """Why nothing is feasible, and the nearest feasible alternative."""
    hw, N = result.hardware, result.world
    by_memory = [c for c in result.rejected if c.memory is not None]
    if by_memory:
        smallest = min(by_memory, key=lambda c: c.predicted_mem_bytes)
        alt = _nearest_device_count(result, upward=True)
        msg = (f"no layout of {N} × {hw.name} fits: the smallest, {smallest.layout.label()}, needs "
               f"{gib(smallest.predicted_mem_bytes)} per rank (params {gib(smallest.memory.params)}, grads "
               f"{gib(smallest.memory.grads)}, optimizer {gib(smallest.memory.optimizer)}, activations "
               f"{gib(smallest.memory.activations)}, margin {gib(smallest.memory.margin)}) against "
               f"{gib(hw.device_memory_bytes)}.")
        if alt:
            msg += f" Nearest feasible: {alt[0]} with {alt[1].layout.label()} ({gib(alt[1].predicted_mem_bytes)})."
        else:
            msg += " Fix: more devices, a shorter data.seq_len or a smaller model."
        return msg
    reasons = collections.Counter(c.reason.split(" Fix:")[0] for c in result.rejected)
    common = reasons.most_common(1)[0][0].rstrip(". ") if reasons else "no candidate"
    alt = _nearest_device_count(result, upward=None)
    msg = f"no layout of {N} devices passes the config rules; the most common reason: {common}."
    if alt:
        msg += f" Nearest feasible: {alt[0]} with {alt[1].layout.label()}."
    return msg


def _nodes_for(result: PlanResult, n: int) -> Optional[int]:
    """The node count a plan of ``n`` devices would use: the result's own when the caller chose
    it and it still fits (divides n, at most devices_per_node each), else :func:`default_nodes`."""
    k = result.nodes
    if result.nodes_given and n % k == 0 and n // k <= result.hardware.devices_per_node:
        return k
    return default_nodes(n, result.hardware)[0]


def _nearest_device_count(result: PlanResult, upward) -> Optional[tuple]:
    """(the options to pass, the best candidate) of the device count nearest to N with a
    feasible layout, each count on the nodes :func:`_nodes_for` gives it; searched over the
    lightest settings only (ZeRO-3 or 0, full recompute, micro-batch 1) to stay quick, with every
    context size the search tried (a long sequence may fit only split over context ranks)."""
    cfg, hw, N = result.config, result.hardware, result.world
    more = dict(expert_keys(cfg.model.resolve()), seq_len=cfg.data.seq_len, max_context=result.max_context)
    if upward:
        tries = [N * k for k in (2, 4, 8, 16, 32, 64)]
    else:
        tries = [n for d in range(1, N + 1) for n in (N - d, N + d) if n >= 1][:16]
    for n in tries:
        nodes = _nodes_for(result, n)
        option = f"--gpus {n}" + (f" --nodes {nodes}" if result.nodes_given else "")
        light = (evaluate(cfg, x, hw, n, nodes) for x in enumerate_layouts(
            n, cfg.train.global_batch, zero_stages=(3,), recompute=("full",), micro_batches=[1], **more))
        best = min((c for c in light if c.feasible), key=_sort_key, default=None)
        if best is None:           # else the first feasible layout without ZeRO
            best = next((c for c in (evaluate(cfg, x, hw, n, nodes)
                                     for x in enumerate_layouts(n, cfg.train.global_batch, zero_stages=(0,),
                                                                **more))
                         if c.feasible), None)
        if best is not None:
            return option, best
    return None


__all__ = ["plan", "evaluate", "PlanResult", "Candidate", "PlanError", "apply_layout", "default_nodes", "check_request",
           "check_top", "split_variants"]
