"""What ``gridshard plan`` prints and writes: the table, ``--json``, ``--explain``, ``--write``."""
from __future__ import annotations

import collections
import copy
import json
import math

import yaml

from ..theory.memory.activations import activation_element_bytes
from ..tensor_scheme import tensor_schemes
from .search import Candidate, PlanResult, gib


def _mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.0f}"


def table(result: PlanResult, top: int = 10) -> str:
    """A fixed-width table of the ``top`` feasible layouts, best first."""
    moe = bool(getattr(result.config.model.resolve(), "experts", 0))
    head = ["#", "layout", "mem/rank MiB", "step s", "compute", "tensor", "ctx"] + ["expert"] * moe + \
        ["pipe", "data", "bubble", "tok/s", "MFU"]
    rows = []
    for i, c in enumerate(result.candidates[:top], 1):
        st = c.step
        rows.append([str(i), c.layout.label(), _mib(c.predicted_mem_bytes), f"{st.total_s:.4g}", f"{st.compute_s:.3g}",
                     f"{st.tensor_comm_s:.3g}", f"{st.context_comm_s:.3g}"] + [f"{st.expert_comm_s:.3g}"] * moe +
                    [f"{st.pipeline_comm_s:.3g}", f"{st.data_comm_s:.3g}",
                     f"{st.bubble_s:.3g}", f"{c.tokens_per_s:,.0f}", "-" if c.mfu is None else f"{c.mfu:.1%}"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    cfg = result.config
    m = cfg.model.resolve()
    lines = [f"gridshard plan: {result.world} × {result.hardware.name} on {result.nodes} node(s); model h={m.hidden} "
             f"L={m.layers} V={m.vocab_size}, global batch {cfg.train.global_batch} × seq {cfg.data.seq_len}, "
             f"{cfg.train.precision}",
             f"layouts: {result.counts.get('feasible', 0)} feasible, {result.counts.get('memory', 0)} too large, "
             f"{result.counts.get('rule', 0)} against the config rules; step s = compute + exposed comm (tensor, "
             f"context, {'expert, ' * moe}pipe, data) + bubble + optimizer/overhead",
             fmt(head), fmt(["-" * w for w in widths])]
    return "\n".join(lines + [fmt(r) for r in rows])


def as_json(result: PlanResult, top: int = 10, rejected: int = 0) -> str:
    """The ``--json`` list: ``top`` feasible layouts best first, then ``rejected`` infeasible ones."""
    out = [c.as_json() for c in result.candidates[:top]]
    out += [c.as_json() for c in result.rejected[:rejected]]
    return json.dumps(out, indent=1)


def explain(result: PlanResult) -> str:
    """Why the top choice wins: its memory and time split, and how the runners-up differ."""
    best = result.best
    mem, st, hw = best.memory, best.step, result.hardware
    lines = [result.nodes_note] * bool(result.nodes_note) + [
             f"Best: {best.layout.label()}",
             f"  memory per rank (worst rank, pipeline rank {best.memory_rank}): params {gib(mem.params)}, grads "
             f"{gib(mem.grads)}, optimizer {gib(mem.optimizer)}, activations {gib(mem.activations)}, buffers "
             f"{gib(mem.comm_buffers + mem.transient)}, baseline {gib(mem.baseline)}, + margin {gib(mem.margin)} "
             f"= {gib(mem.total_with_margin)} of {gib(hw.device_memory_bytes)}",
             f"  step {st.total_s:.4g} s = compute {st.compute_s:.3g} + tensor comm {st.tensor_comm_s:.3g} + pipeline "
             f"comm {st.pipeline_comm_s:.3g} + data comm (exposed) {st.data_comm_s:.3g} + bubble {st.bubble_s:.3g} "
             f"+ optimizer {st.optimizer_s:.3g} + overhead {st.overhead_s:.3g}"
             + (f" + context comm (exposed) {st.context_comm_s:.3g}" if best.layout.context > 1 else "")
             + (f" + expert comm {st.expert_comm_s:.3g}" if best.layout.expert > 1 else ""),
             f"  links: tensor {st.details['links']['tensor']}, "
             + (f"context {st.details['links']['context']}, " if best.layout.context > 1 else "")
             + f"pipeline {st.details['links']['pipeline']}, data "
             f"{st.details['links']['data']} node; {st.details['micro_batches']} micro-batches per step"
             + (f", bubble fraction {st.details['bubble_fraction']:.3f}" if best.layout.pipeline > 1 else "")]
    if st.details.get("regime") == "throughput":
        lines.append(f"  {result.world // max(1, result.nodes)} ranks share {hw.compute_slots_per_node:g} compute slots "
                     f"per node: the step is the cores' work (the ranks' mean busy time × "
                     f"{st.details['contention']:.3g}), {st.details['throughput_bound_s']:.4g} s, above the critical "
                     f"path at full speed, {st.details['latency_bound_s']:.4g} s; a bubble costs nothing there "
                     f"(cost_time: two bounds)")
    lines += _context_reason(result) + _expert_reason(result) + _depth_reason(result)
    # every registered mode that summarises its layouts (``plan_title``, ``plan_summary``)
    lines += [line for scheme in tensor_schemes() if scheme.plan_title for line in _mode_reason(result, scheme)]
    lines += _grad_reduce_reason(result)
    shape = lambda l: (l.data, l.pipeline, l.context, l.tensor, l.tensor_mode, l.sequence_parallel,  # noqa: E731
                       l.tensor_depth)
    firsts = {}                            # the fastest candidate of each shape
    for c in result.candidates[1:]:
        firsts.setdefault(shape(c.layout), c)
    for c in [c for key, c in firsts.items() if key != shape(best.layout)][:3]:
        lines.append(f"  vs {c.layout.label()}: {c.predicted_step_s / st.total_s:.2f}× the step time "
                     f"({_why(best, c)}), {c.predicted_mem_bytes / best.predicted_mem_bytes:.2f}× the memory")
    too_big = [c for c in result.rejected if c.memory is not None]
    if too_big:
        fastest_rejected = min(too_big, key=lambda c: c.predicted_mem_bytes)
        lines.append(f"  {len(too_big)} layouts do not fit, e.g. {fastest_rejected.layout.label()} needs "
                     f"{gib(fastest_rejected.predicted_mem_bytes)}")
    return "\n".join(lines)


def _context_reason(result: PlanResult) -> list:
    """Why the best layout splits sequences (C > 1), against the best layout without (C = 1): how
    much faster it is, and whether C = 1 fits at all at the best layout's recompute setting (the
    smallest such C = 1 layout's activations against the device); [] when C = 1 wins."""
    best, hw = result.best, result.hardware
    C = best.layout.context
    if C == 1:
        return []
    rc = best.layout.recompute
    plain = [c for c in result.candidates if c.layout.context == 1]
    out = [f"  why C = {C} ({best.layout.context_mode}): each rank holds S/{C} = {result.config.data.seq_len // C} "
           f"tokens of every sequence, so its activations are {gib(best.memory.activations)}"]
    same_rc = [c for c in result.rejected if c.memory is not None and c.layout.context == 1 and c.layout.recompute == rc]
    plain_rc = [c for c in plain if c.layout.recompute == rc]
    if same_rc and not plain_rc:
        small = min(same_rc, key=lambda c: c.predicted_mem_bytes)
        out.append(f"  C = 1 does not fit with rc={rc}: the smallest such layout, {small.layout.label()}, needs "
                   f"{gib(small.predicted_mem_bytes)} per rank (activations {gib(small.memory.activations)}) > "
                   f"{gib(hw.device_memory_bytes)}")
    for what, p in (("", plain[0] if plain else None), (f" with rc={rc}", plain_rc[0] if plain_rc else None)):
        if p is not None and (not what or p is not plain[0]):
            out.append(f"  the fastest C = 1 layout{what}, {p.layout.label()}, takes {p.predicted_step_s:.4g} s per "
                       f"step, {p.predicted_step_s / best.predicted_step_s:.2f}× this one ({_why(best, p)})")
    if not plain:
        out.append("  no C = 1 layout fits at all")
    if best.layout.context_mode == "ring":
        out.append(f"  the ring's k/v sends overlap the attention compute (assumed): "
                   f"{best.step.context_comm_s:.3g} s exposed per step")
    return out


def _expert_reason(result: PlanResult) -> list:
    """An MoE model's expert ranks (issue 38): what E the best layout takes, on which link and at what
    dispatch cost; against the fastest feasible layout of every other E (or, where none fits, the
    smallest one's memory); and the other dispatcher at the same layout. [] for a dense model."""
    import dataclasses

    mc, best = result.config.model.resolve(), result.best
    n = getattr(mc, "experts", 0)
    if not n:
        return []
    L, st = best.layout, best.step
    E = L.expert
    out = [f"  experts: {n} per MoE layer, {mc.experts_per_token} active per token; E = {E}: each rank holds "
           f"{n // E} of them and their optimizer state, {gib(best.memory.params)} of parameters in all"
           + (f"; tokens move by {L.expert_dispatch} on the {st.details['links']['expert']} link, "
              f"{st.expert_comm_s:.3g} s per step (exposed: experts wait for their rows)" if E > 1 else
              "; no dispatch")]
    fastest, smallest = {}, {}
    for c in result.candidates:
        fastest.setdefault(c.layout.expert, c)
    for c in result.rejected:
        if c.memory is not None and c.layout.expert not in fastest:
            e = c.layout.expert
            if e not in smallest or c.predicted_mem_bytes < smallest[e].predicted_mem_bytes:
                smallest[e] = c
    for e in sorted(set(fastest) | set(smallest)):
        if e == E:
            continue
        if e in fastest:
            c = fastest[e]
            out.append(f"  E = {e}: the fastest, {c.layout.label()}, {c.predicted_step_s / st.total_s:.2f}× the step "
                       f"({_why(best, c)}), {c.predicted_mem_bytes / best.predicted_mem_bytes:.2f}× the memory")
        else:
            c = smallest[e]
            m = c.memory
            out.append(f"  E = {e}: no layout fits; the smallest, {c.layout.label()}, needs "
                       f"{gib(c.predicted_mem_bytes)} (params {gib(m.params)}, grads {gib(m.grads)}, optimizer "
                       f"{gib(m.optimizer)}, activations {gib(m.activations)}, buffers "
                       f"{gib(m.comm_buffers + m.transient)}) > {gib(result.hardware.device_memory_bytes)}")
    other = "all_gather" if L.expert_dispatch == "all_to_all" else "all_to_all"
    twin = dataclasses.replace(L, expert_dispatch=other)
    twin = next((c for c in result.candidates if c.layout == twin), None)
    if E > 1 and twin is not None:
        out.append(f"  {other} at this layout: {twin.predicted_step_s / st.total_s:.2f}× the step (expert comm "
                   f"{twin.step.expert_comm_s:.3g} s)")
    elif E > mc.experts_per_token:
        out.append(f"  all_gather is not tried at E = {E} > k = {mc.experts_per_token}: it would move every rank's "
                   f"tokens, E/k× the all-to-all's bytes (planner.layouts.expert_choices)")
    return out


def _grad_reduce_reason(result: PlanResult) -> list:
    """How the best layout's ZeRO-2/3 accumulate under its pipeline (``train.overlap_grad_reduce``,
    enumerated where it matters: :func:`~gridshard.planner.layouts.overlap_choices`): sharded (a
    reduce-scatter every micro-batch, no whole gradient between them) or whole-grad (one reduction
    per step, the whole gradient held), against the same layout with the other choice; [] where
    the flag was not a choice."""
    import dataclasses

    best = result.best
    L = best.layout
    twin_layout = dataclasses.replace(L, overlap_grad_reduce=not L.overlap_grad_reduce)
    twin = next((c for c in list(result.candidates) + list(result.rejected) if c.layout == twin_layout), None)
    if twin is None:
        return []
    name = lambda lay: "sharded accumulation (reduce-scatter every micro-batch)" if lay.overlap_grad_reduce \
        else "whole-grad accumulation (one reduction per step)"  # noqa: E731
    head = f"  gradients: {name(L)}, train.overlap_grad_reduce={str(L.overlap_grad_reduce).lower()}"
    if twin.memory is None:
        return [f"{head}; the other choice breaks a config rule: {twin.reason}"]
    if not twin.feasible:
        return [f"{head}: {name(twin_layout)} needs {gib(twin.predicted_mem_bytes)} per rank (grads "
                f"{gib(twin.memory.grads)}), above the device's {gib(result.hardware.device_memory_bytes)}"]
    why = "the faster step" if best.predicted_step_s < twin.predicted_step_s else "the same step time, no more memory"
    mem = "less" if best.predicted_mem_bytes < twin.predicted_mem_bytes else \
        "the same" if best.predicted_mem_bytes == twin.predicted_mem_bytes else "more"
    return [f"{head}, chosen for {why} ({mem} memory): {best.predicted_step_s:.4g} s per step vs "
            f"{twin.predicted_step_s:.4g} s with {name(twin_layout)} (exposed data comm {best.step.data_comm_s:.3g} vs "
            f"{twin.step.data_comm_s:.3g} s); memory {gib(best.predicted_mem_bytes)} vs "
            f"{gib(twin.predicted_mem_bytes)} per rank (backward transient, the gradient buffers and casts: "
            f"{gib(best.memory.transient)} vs {gib(twin.memory.transient)})"]


def _fastest(cands, pred):
    return next((c for c in cands if pred(c.layout)), None)


def _against_rival(result: PlanResult, title: str, is_kind, is_rival, which: str, summary, middle) -> list:
    """A kind of layout against its rival at the same T (:func:`_depth_reason`, :func:`_mode_reason`): the
    fastest feasible layout where ``is_kind(layout)`` (``summary(it, verdict)`` after its label) and the
    fastest other feasible layout with the same D, P, C and T, one where ``is_rival(layout, its layout)``
    first, compared by step, tensor comm, ``middle(it, rival)``, parameter bytes and memory; or why no
    layout of the kind runs ([] when the search had none; ``which`` names the missing rival)."""
    kind = _fastest(result.candidates, is_kind)
    if kind is None:
        refused = [c for c in result.rejected if is_kind(c.layout)]
        if not refused:
            return []
        why = collections.Counter(c.reason.split(" Fix:")[0] if c.memory is None else "memory" for c in refused)
        return [f"  {title}: none of {len(refused)} layouts runs; the most common reason: {why.most_common(1)[0][0]}"]
    L, best = kind.layout, result.best
    same = lambda l: (not is_kind(l) and (l.data, l.pipeline, l.context, l.tensor) ==  # noqa: E731
                      (L.data, L.pipeline, L.context, L.tensor))
    rival = _fastest(result.candidates, lambda l: same(l) and is_rival(l, L)) or _fastest(result.candidates, same)
    verdict = "is the best layout" if kind is best else \
        f"takes {kind.predicted_step_s / best.predicted_step_s:.2f}× the best step"
    out = [f"  {title}: {L.label()} {summary(kind, verdict)}"]
    if rival is None:
        return out + [f"  no {which} at D{L.data} P{L.pipeline} C{L.context} T{L.tensor} passes the rules and fits, "
                      f"to compare with"]
    wins = kind.predicted_step_s < rival.predicted_step_s
    return out + [
        f"  {'wins' if wins else 'loses'} against {rival.layout.label()} at the same T: {kind.predicted_step_s:.4g} "
        f"vs {rival.predicted_step_s:.4g} s per step; tensor comm {kind.step.tensor_comm_s:.3g} vs "
        f"{rival.step.tensor_comm_s:.3g} s{middle(kind, rival)}, params {gib(kind.memory.params)} vs "
        f"{gib(rival.memory.params)} and memory {gib(kind.predicted_mem_bytes)} vs {gib(rival.predicted_mem_bytes)} "
        f"per rank"]


def _depth_reason(result: PlanResult) -> list:
    """2.5D against 2D at the same T (docs/planner.md, "2.5D"): the fastest feasible 2.5D layout and
    the fastest other layout with the same D, P, C and T (2D where T is a square, else 1D), their
    tensor comm (SUMMA on m/d rows: fewer, shorter rounds), exposed data comm (the depth joins the
    gradient reduction) and parameter bytes (weights replicated d times); or why no 2.5D layout runs."""
    def summary(deep: Candidate, verdict: str) -> str:
        L = deep.layout
        q = math.isqrt(L.tensor // L.tensor_depth)
        return (f"(q = {q}, d = {L.tensor_depth}: {L.tensor_depth} depth layers of a {q}×{q} SUMMA grid on m/d = "
                f"{L.micro_batch // L.tensor_depth} rows each, weights replicated d times, the depth summed in the "
                f"data × context × depth reduction) {verdict}")

    def middle(deep: Candidate, flat: Candidate) -> str:
        a, b = deep.step, flat.step
        return (f" ({a.details['tensor_calls_per_microbatch']} vs {b.details['tensor_calls_per_microbatch']} calls "
                f"per micro-batch), compute {a.compute_s:.3g} vs {b.compute_s:.3g} s, data comm (exposed, the depth "
                f"in the reduction) {a.data_comm_s:.3g} vs {b.data_comm_s:.3g} s")

    return _against_rival(result, "2.5D", lambda l: l.tensor_depth > 1, lambda l, L: l.mode == L.layer_layout().mode,
                          "layout without depth", summary, middle)


def _layer_traffic(result: PlanResult, c: Candidate) -> tuple:
    """(ring wire bytes, of them on links across nodes, calls) one rank's tensor group moves per decoder
    layer and micro-batch (:func:`~gridshard.planner.price_tensor.tensor_volumes` of the layout each rank
    runs: the scheme's ``tensor_comm``; at 3D each cube axis on its own link)."""
    L, links = c.layout.layer_layout(), c.step.details["links"]
    mc, s = result.config.model.resolve(), result.config.data.seq_len // L.context
    e = activation_element_bytes(result.config.train.precision)        # the compute dtype's bytes
    per_axis = L.mode.tensor_comm(mc, L, s, 1, False, False, e)       # axis → CommVolumes
    levels = links.get("tensor_axes", {})
    wire = {a: sum(v.wire_bytes() for v in vols) for a, vols in per_axis.items()}
    return (sum(wire.values()), sum(w for a, w in wire.items() if levels.get(a, links["tensor"]) == "inter"),
            sum(sum(v.calls.values()) for vols in per_axis.values() for v in vols))


def _mode_reason(result: PlanResult, scheme) -> list:
    """A mode against its rivals at the same T (docs/planner.md, "3D"): the fastest feasible layout of
    ``scheme`` and the fastest feasible layout of one of its ``plan_rivals`` with the same D, P, C and T
    (else any other), with what decides between them — tensor bytes and calls per decoder layer and
    micro-batch, which tensor axes leave a node, parameter bytes; or why no layout of the mode runs."""
    def middle(cube: Candidate, other: Candidate) -> str:
        (wa, xa, ca), (wb, xb, cb) = _layer_traffic(result, cube), _layer_traffic(result, other)
        mib = lambda n: f"{n / (1 << 20):,.4g}"  # noqa: E731
        return (f" — per rank, decoder layer and micro-batch {mib(wa)} vs {mib(wb)} MiB on the wire, of which "
                f"{mib(xa)} vs {mib(xb)} MiB across nodes, {ca} vs {cb} calls; compute {cube.step.compute_s:.3g} vs "
                f"{other.step.compute_s:.3g} s")

    return _against_rival(result, scheme.plan_title, lambda l: l.mode == scheme,
                          lambda l, L: l.mode in scheme.plan_rivals, "other layout",
                          lambda c, verdict: scheme.plan_summary(c.layout, c.step.details["links"], verdict), middle)


def _why(best: Candidate, other: Candidate) -> str:
    """The step-time component that differs most between two candidates."""
    a, b = best.step.as_dict(), other.step.as_dict()
    parts = [k for k in a if k != "total_s"]
    k = max(parts, key=lambda k: abs(b[k] - a[k]))
    return f"{k[:-2].replace('_', ' ')} {b[k]:.3g} s vs {a[k]:.3g} s"


def written_config(result: PlanResult, layout=None) -> dict:
    """The input config (as written, plus the overrides) with the chosen (``layout``, default the best)
    ``parallel:`` section
    (``stage_layers`` when the layout has an explicit split, else none) and
    ``train.zero/recompute/micro_batch/overlap_grad_reduce`` merged in."""
    from ..config.load import apply_overrides, default_config_dict, read_yaml

    src = result.source
    if isinstance(src, str):
        raw = read_yaml(src)
    elif isinstance(src, dict):
        raw = copy.deepcopy(src)
    elif src is None:
        raw = default_config_dict()
    else:
        raw = src.model_dump()
    raw = apply_overrides(raw, result.overrides)
    layout = layout if layout is not None else result.best.layout
    parallel = {**(raw.get("parallel") or {}), **layout.parallel_section()}
    if parallel.get("stage_layers") is None:          # the default split: no key
        parallel.pop("stage_layers", None)
    raw["parallel"], raw["train"] = parallel, {**(raw.get("train") or {}), **layout.train_section()}
    return raw


def write_config(result: PlanResult, path: str):
    """Write :func:`written_config` as YAML after the full config validation at the planned world
    size. A layout or model rule that fails raises ConfigError (nothing written); a data-section
    failure (e.g. a cluster path absent here) is returned as a warning and the file is written."""
    from ..config import resolve_config
    from ..errors import ConfigError

    raw = written_config(result)
    warning = None
    try:
        resolve_config(raw, world_size=result.world, cuda_available=result.hardware.name != "cpu")
    except ConfigError as e:
        if not str(e).startswith("data."):
            raise
        warning = f"{path} written, but its data section does not validate on this machine: {e}"
    c = result.best
    header = (f"# written by gridshard plan: {c.layout.label()} on {result.world} × {result.hardware.name}; predicted "
              f"{gib(c.predicted_mem_bytes)} per rank, {c.predicted_step_s:.4g} s per step\n")
    with open(path, "w") as f:
        f.write(header)
        yaml.safe_dump(raw, f, sort_keys=False)
    return warning


__all__ = ["table", "as_json", "explain", "written_config", "write_config"]
