"""The reference trainers of ``gridshard plan --calibrate`` and what is fitted to them.

The cost model derives a step from GEMM rates, copy bandwidth and collective timings; what it
cannot derive — the element-wise bandwidth of real layers, per-layer and per-step overheads,
the work around each tensor-parallel collective and per pipeline send — is fitted here so that
the model gives back gridshard's own trainer on this machine (:func:`fit_to_reference_trainers`),
on :func:`reference_runs` of the ``tiny`` preset measured by :func:`trainer_reference`.
"""
from __future__ import annotations

import statistics
import time


REFERENCE_STEPS = 16


def alternating_step_times(trainers: list, steps: int, warmup: int = 2) -> list:
    """Seconds of each trainer's step k, the trainers taking turns step by step in the same
    processes (a barrier before and after each step, so every rank times the same step);
    steps < ``warmup`` are not timed. One list per trainer."""
    import torch.distributed as dist

    times = [[] for _ in trainers]
    for k in range(steps):
        for i, tr in enumerate(trainers):
            dist.barrier()
            t0 = time.perf_counter()
            tr.step(k)
            dist.barrier()
            if k >= warmup:
                times[i].append(time.perf_counter() - t0)
    return times


REFERENCE_TENSOR = {"none": 1, "1d": 2, "2d": 4}       # the reference trainers' T per tensor mode
REFERENCE_MICRO = 2                                     # sequences per micro-batch ...
REFERENCE_WIDE_MICRO = 16                               # ... and the plain pair's second token count
REFERENCE_PIPELINE = (2, 4)                             # the pipeline pair: P = 2, A = 4 micro-batches
REFERENCE_LAYERS = (1, 4)                               # the layer counts of a pair (P = 1)


def reference_config(world: int, layers: int, mode: str = "none", micro: int = REFERENCE_MICRO,
                     pipeline: int = 1) -> dict:
    """The config of a reference trainer (:func:`trainer_reference`): the ``tiny`` preset at
    ``layers`` layers, T = ``REFERENCE_TENSOR[mode]``, P = ``pipeline``, D = world / (P·T), one
    micro-batch of ``micro`` × 64 tokens per data rank (P = 1) or ``REFERENCE_PIPELINE[1]`` of them."""
    T = REFERENCE_TENSOR[mode]
    D = world // (T * pipeline)
    A = REFERENCE_PIPELINE[1] if pipeline > 1 else 1
    return {"model": {"preset": "tiny", "layers": layers},
            "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "pipeline": pipeline},
            "data": {"kind": "stdlib", "seq_len": 64, "max_bytes": 200_000},
            "train": {"global_batch": micro * D * A, "micro_batch": micro, "steps": REFERENCE_STEPS,
                      "warmup_steps": 1}}


def reference_runs(world: int) -> list:
    """(key, keyword arguments of :func:`reference_config`, layer counts) of the reference trainer
    pairs that fit ``world`` ranks: the plain pair at two token counts, 1D, 2D, and a pipeline."""
    L = REFERENCE_LAYERS
    runs = [("none", {}, L), (f"none_m{REFERENCE_WIDE_MICRO}", {"micro": REFERENCE_WIDE_MICRO}, L)]
    runs += [(m, {"mode": m}, L) for m, T in REFERENCE_TENSOR.items()
             if T > 1 and world % T == 0]
    P = REFERENCE_PIPELINE[0]
    if world % P == 0:
        runs.append(("pipeline", {"pipeline": P}, (P, 2 * P)))
    return runs


def trainer_reference(world: int) -> tuple:
    """Step seconds of the real trainer (``gridshard.engine.Trainer``, :func:`reference_config`)
    for each run of :func:`reference_runs` at its two layer counts, on all ranks at once: first the
    plain pair alone (the memory model's modelled bytes of it and the peak memory after it are
    the floor), then every trainer in the same processes, taking turns step by step so that a
    change of machine load hits them all alike (the fits difference them); medians over the
    rounds: ``{key: {layers: seconds}}``."""
    from ..engine import Trainer
    from ..engine.metrics import peak_memory_bytes

    runs = reference_runs(world)
    key0, kwargs0, counts0 = runs[0]
    plain = [Trainer(reference_config(world, layers, **kwargs0), progress=False) for layers in counts0]
    alternating_step_times(plain, 3, warmup=3)
    modelled = sum(tr.predicted_mem.modelled for tr in plain if tr.predicted_mem is not None)
    floor = peak_memory_bytes(plain[0].device)
    trainers = dict(zip([(key0, layers) for layers in counts0], plain))
    for key, kwargs, counts in runs[1:]:
        for layers in counts:
            trainers[key, layers] = Trainer(reference_config(world, layers, **kwargs), progress=False)
    times = alternating_step_times(list(trainers.values()), REFERENCE_STEPS)
    out: dict = {}
    for (key, layers), ts in zip(trainers, times):
        out.setdefault(key, {})[layers] = statistics.median(ts)
    return out, int(modelled), floor


def reference_step_s(hw, nproc: int, layers: int, mode: str = "none", micro: int = REFERENCE_MICRO,
                     pipeline: int = 1) -> float:
    """The planner's step seconds (:func:`gridshard.planner.evaluate`) for a reference trainer
    (:func:`reference_config`, its own layout) on the hardware ``hw`` (a Hardware, or a profile dict)."""
    from ..config import load_config
    from .fit import config_layout
    from .hardware import load_hardware
    from .search import evaluate

    cfg = load_config(reference_config(nproc, layers, mode, micro, pipeline))
    return evaluate(cfg, config_layout(cfg), load_hardware(hw), nproc).predicted_step_s


def _solve_increasing(f, target: float, start: float = 1e-3) -> float:
    """The x ≥ 0 with f(x) = ``target`` for f non-decreasing (0 when f(0) ≥ target already):
    bracket by doubling from ``start``, then bisect to a relative 1e-10."""
    if f(0.0) >= target:
        return 0.0
    hi = start
    while f(hi) < target:
        hi *= 2.0
        if hi > 1e6:
            return hi
    lo = 0.0
    while hi - lo > 1e-10 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


SWEEPS = 2          # the terms interact only where a change flips a bound; two passes settle them


def fit_to_reference_trainers(profile: dict, m: dict, nproc: int) -> None:
    """Fit the terms the cost model cannot derive from GEMM, copy and collective timings, so that
    it gives back gridshard's own trainer on this machine (:func:`trainer_reference`). Each term
    is the value at which the priced runs equal the measured ones — solved by bisection (the
    step is non-decreasing in each term, piecewise linear where it switches bounds), clamped at
    0, the overhead terms in ``SWEEPS`` passes; per layer = the slope between a pair's two layer
    counts:

    * ``elementwise_bandwidth`` — first, with the overheads at 0: the plain pair's per-layer growth
      from micro-batch 2 to 16 (GEMMs and element-wise passes grow; overheads do not), when the
      GEMMs alone do not explain it; else ``memory_bandwidth`` stays in use;
    * ``layer_overhead_s`` — the plain pair's per-layer time at micro-batch 2;
    * ``step_overhead_s`` — the shallower plain trainer's step;
    * ``tensor_call_overhead_s[mode]`` — the T = 2 (1D) / T = 4 (2D) pair's per-layer time: the
      autograd nodes, dispatch and copies around each tensor collective;
    * ``p2p_call_overhead_s`` — the P = 2 pair's (A = 4) mean step: the schedule's own work per
      micro-batch and boundary (Python, the P2P operations' setup, autograd across the boundary).

    Without the measurements a term keeps the value it has."""
    measured = lambda t: {int(k): float(v) for k, v in t.items()}  # noqa: E731
    slope = lambda t: (t[max(t)] - t[min(t)]) / (max(t) - min(t))  # noqa: E731   per layer
    plain = measured(m["overheads"])
    lo, hi = min(plain), max(plain)

    def per_layer(run: dict, **changes) -> float:
        return (reference_step_s(dict(profile, **changes), nproc, hi, **run)
                - reference_step_s(dict(profile, **changes), nproc, lo, **run)) / (hi - lo)

    wide = (m.get("overheads_tokens") or {}).get(str(REFERENCE_WIDE_MICRO))
    if wide:
        zero = {"layer_overhead_s": 0.0, "step_overhead_s": 0.0, "tensor_call_overhead_s": {}}
        grown = slope(measured(wide)) - slope(plain)
        growth = lambda inv_bw: (per_layer({"micro": REFERENCE_WIDE_MICRO}, **zero, elementwise_bandwidth=1 / inv_bw)  # noqa: E731
                                 - per_layer({"micro": REFERENCE_MICRO}, **zero, elementwise_bandwidth=1 / inv_bw))
        inv = _solve_increasing(lambda x: growth(max(x, 1e-30)), grown, start=1e-10)
        if 0 < inv < 1e6:
            profile["elementwise_bandwidth"] = 1.0 / inv
    tensor = {mode: measured(t) for mode, t in (m.get("overheads_tensor") or {}).items()}
    pipe = measured(m["overheads_pipeline"]) if m.get("overheads_pipeline") else None
    profile.setdefault("tensor_call_overhead_s", {})
    for _ in range(SWEEPS):
        profile["layer_overhead_s"] = _solve_increasing(lambda x: per_layer({}, layer_overhead_s=x), slope(plain))
        profile["step_overhead_s"] = _solve_increasing(
            lambda x: reference_step_s(dict(profile, step_overhead_s=x), nproc, lo), plain[lo])
        for mode, times in tensor.items():
            calls = dict(profile["tensor_call_overhead_s"])
            profile["tensor_call_overhead_s"] = dict(calls, **{mode: _solve_increasing(
                lambda x: per_layer({"mode": mode}, tensor_call_overhead_s=dict(calls, **{mode: x})), slope(times))})
        if pipe:
            P = REFERENCE_PIPELINE[0]
            profile["p2p_call_overhead_s"] = _solve_increasing(
                lambda x: statistics.mean(reference_step_s(dict(profile, p2p_call_overhead_s=x), nproc, n, pipeline=P)
                                          for n in pipe), statistics.mean(pipe.values()))


__all__ = ["trainer_reference", "fit_to_reference_trainers", "reference_config", "reference_runs", "reference_step_s",
           "alternating_step_times", "REFERENCE_WIDE_MICRO"]
