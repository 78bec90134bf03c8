"""What expert tensor parallelism could at best gain, by the planner's own cost model: the fastest
layouts with tensor parallelism (T > 1) of an MoE config, with the experts' repeated FLOPs taken
out — each MoE block's FLOPs divided by T as if every expert's width were split T ways, the bubble
shrinking with the micro-batch's time, and the split's all-reduces free (a bound no implementation
reaches) — against the best layout of the search. If even that bound is slower than the best
layout, splitting the experts inside the tensor group would not change what the run should do.

    .venv/bin/python benchmarks/plan_expert_tensor_split.py configs/mixtral_8x7b.yaml 64
    .venv/bin/python benchmarks/plan_expert_tensor_split.py configs/deepseek_v3.yaml 1024

(1024 devices: ZeRO-1 and micro-batches up to 4 only, to stay within a minute.)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gridshard.planner import plan  # noqa: E402
from gridshard.planner.cost_memory import stage_layers_of_rank  # noqa: E402
from gridshard.planner.price_expert import moe_flops_per_token, moe_layer_count  # noqa: E402


def bound_without_repeat(cand, mc, seq: int) -> float:
    """The candidate's step with its MoE blocks' repeated FLOPs removed (module docstring), priced
    at the rate the planner priced its compute."""
    L = cand.layout.layer_layout()
    ids = stage_layers_of_rank(mc.layers, L.pipeline, L.virtual_stages, L.stage_layers)[0] if L.pipeline > 1 else None
    A, b = cand.step.details["micro_batches"], cand.step.details["bubble_fraction"]
    repeated = L.micro_batch * seq / L.context * moe_layer_count(mc, ids) * moe_flops_per_token(mc) * (1 - 1 / L.tensor)
    repeated *= 4 / 3 if L.recompute == "full" else 1
    rate = cand.step.details["flops_per_microbatch"] / (cand.step.compute_s / A)
    return cand.predicted_step_s - A * repeated / rate / (1 - b)


def main() -> None:
    path, gpus = sys.argv[1], int(sys.argv[2])
    r = plan(path, gpus, hardware="h100", **(dict(zero_stages=(1,), max_micro_batch=4) if gpus > 64 else {}))
    mc, best = r.config.model.resolve(), r.best
    print(f"best: {best.layout.label()}: {best.predicted_step_s:.3f} s")
    rows = sorted(((bound_without_repeat(c, mc, r.config.data.seq_len), c) for c in r.candidates
                   if c.layout.layer_layout().tensor > 1), key=lambda x: x[0])
    for bound, c in rows[:3]:
        print(f"T > 1: {c.layout.label()}: {c.predicted_step_s:.3f} s, without the repeat ≥ {bound:.3f} s = "
              f"{bound / best.predicted_step_s:.2f}× the best")


if __name__ == "__main__":
    main()
