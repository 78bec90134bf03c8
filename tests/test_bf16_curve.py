"""bf16 follows the fp32 loss curve as closely as fp32 follows itself (issue 23; the measurement
behind it: ``benchmarks/bench_bf16_curve.py``, quoted in docs/memory.md "bf16 against fp32").

Over 100 steps of the tiny preset at (D=4, T=1, none) the per-step relative loss difference r_k =
(loss_k − loss_k^fp32) / loss_k^fp32 of a bf16 run stays within 0.07 % for 30 steps and then reaches
1–3 %. An fp32 run whose initial weights are rounded to bf16 once — one perturbation of bf16's size
(2⁻⁹ relative) at step 0, then no bf16 arithmetic at all — does the same at the same steps, with the
same sign (step 51: +2.4 %; bf16 ZeRO-0: +2.6 %): from step ~33 on this small run at lr 3e-3
amplifies any perturbation of that size tenfold (four such perturbed fp32 runs: max |r| 1.1–3.0 %,
mean |r| 0.27–0.59 %; bf16 ZeRO 0–3: 0.9–2.7 % and 0.17–0.65 %; ZeRO-1 = ZeRO-2 = ZeRO-3 bit for bit
since ZeRO-0/1 accumulate in fp32). A 1 % bound per step over 100 steps is therefore not met by fp32
itself, and two ZeRO stages, whose gradient sums differ in the last fp32 bit, round some bf16
parameter copies differently — a perturbation of the same size — and part by more than 2e-3 from
step ~32 on.
What is asserted is what holds (measured values in brackets):

* steps 1–30: every bf16 run within 0.3 % of fp32 per step (≤ 0.07 %), and ZeRO-0 within the
  issue's 2e-3 of ZeRO-3 (9.7e-4);
* steps 1–100: each bf16 run's max |r| and mean |r| at most 1.5× those of the fp32 run perturbed
  once (ratios ≤ 1.08 and ≤ 1.11), which itself leaves the 1 % band (the reason no stricter
  bound is asserted).
"""
import pytest

from gridshard.testing import run_on_ranks

STEPS, EARLY = 100, 30


def _body():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_bf16_curve.py")
    spec = importlib.util.spec_from_file_location("bench_bf16_curve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = lambda **t: bench.layout_config("4,1,none", STEPS, **t)          # noqa: E731
    return {"fp32": bench._run(cfg(zero=0)), "perturbed": bench._run(cfg(zero=0), setup=bench._perturb(0)),
            "bf16 ZeRO-0": bench._run(cfg(zero=0, precision="bf16")),
            "bf16 ZeRO-3": bench._run(cfg(zero=3, precision="bf16"))}


@pytest.mark.wide
def test_bf16_follows_fp32_as_closely_as_fp32_perturbed_once():
    out = run_on_ranks(4, _body, timeout=900)[0]
    ref = out["fp32"]
    rel = {k: [abs(a - b) / b for a, b in zip(v, ref)] for k, v in out.items() if k != "fp32"}
    stages = zip(out["bf16 ZeRO-0"][:EARLY], out["bf16 ZeRO-3"][:EARLY])
    assert max(abs(a - b) for a, b in stages) < 2e-3
    base = rel.pop("perturbed")
    assert ref[-1] < 0.6 * ref[0]                                  # it learns
    assert max(base) > 1e-2, max(base)                            # fp32 itself leaves the 1 % band
    for name, r in rel.items():
        assert max(r[:EARLY]) < 3e-3, (name, r[:EARLY])
        assert max(r) <= 1.5 * max(base), (name, max(r), max(base))
        assert sum(r) <= 1.5 * sum(base), (name, sum(r) / STEPS, sum(base) / STEPS)
