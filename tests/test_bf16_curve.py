"""bf16 follows the fp32 loss curve (issue 23; the measurement behind it:
``benchmarks/bench_bf16_curve.py``, quoted in docs/memory.md "bf16 against fp32").

Two regimes of the same 100-step tiny run, (D=4, T=1, none) and (2, 2, 1D+SP):

* **stable** (lr 1e-3 → 1e-4, 10 warm-up steps): the issue's bound holds as stated. Every bf16
  run is within 1 % of the fp32 curve at every step (measured ≤ 0.15 %), the ZeRO stages agree
  within 2e-3 relative (ZeRO-1 = ZeRO-2 = ZeRO-3 bit for bit; ZeRO-0, whose all-reduce sums in
  another order, within 1.2e-3), and fp32 agrees across stages to its own rounding (ZeRO-3 against
  ZeRO-0: 9.1e-6 after 100 steps, asserted < 5e-5; at D = 4 only, where the sums' orders differ).
* **edge of stability** (lr 3e-3, 2 warm-up steps, the benchmark's default): from step ~33 on the
  run amplifies any perturbation of bf16's size (2⁻⁹ relative) tenfold. An fp32 run whose initial
  weights are rounded to bf16 once — then no bf16 arithmetic at all — leaves the 1 % band itself
  (max |r| 2.5 %), so no per-step bound tighter than that run's holds for anything there. What is
  asserted: steps 1–30 every bf16 run within 0.3 % (≤ 0.07 %) and ZeRO-0 within 2e-3 of ZeRO-3;
  over 100 steps each bf16 run's max |r| and mean |r| at most 1.5× those of the rounded-once fp32
  run (ratios ≤ 1.08 and ≤ 1.11).
"""
import pytest

from gridshard.testing import run_on_ranks

STEPS, EARLY = 100, 30
STABLE = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10}


def _bench():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_bf16_curve.py")
    spec = importlib.util.spec_from_file_location("bench_bf16_curve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _stable_body(layout, zeros):
    bench = _bench()
    cfg = lambda **t: bench.layout_config(layout, STEPS, **STABLE, **t)          # noqa: E731
    out = {"fp32": bench._run(cfg(zero=zeros[0]))}
    if zeros[0] == 0:                 # fp32 across stages: ZeRO-3 against ZeRO-0's other summation order
        out["fp32 ZeRO-3"] = bench._run(cfg(zero=3))
    out.update({f"bf16 ZeRO-{z}": bench._run(cfg(zero=z, precision="bf16")) for z in zeros})
    return out


@pytest.mark.wide
@pytest.mark.parametrize("layout,zeros", [("4,1,none", (0, 1, 2, 3)), ("2,2,1d+sp", (1, 3))])
def test_bf16_within_one_percent_of_fp32_in_the_stable_regime(layout, zeros):
    d, t, _ = layout.split(",")
    out = run_on_ranks(int(d) * int(t), _stable_body, layout, zeros, timeout=900)[0]
    ref = out.pop("fp32")
    assert ref[-1] < 0.6 * ref[0]                                           # it learns
    if "fp32 ZeRO-3" in out:
        assert max(abs(a - b) / b for a, b in zip(out.pop("fp32 ZeRO-3"), ref)) < 5e-5    # 100 steps: 9.1e-6
    for name, losses in out.items():
        worst = max(abs(a - b) / b for a, b in zip(losses, ref))
        assert worst < 1e-2, (name, worst)
    runs = list(out.values())
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            assert max(abs(x - y) / y for x, y in zip(a, b)) < 2e-3
    assert out[f"bf16 ZeRO-{zeros[-1]}"] == out[f"bf16 ZeRO-{zeros[-2]}"]      # ZeRO-1/2/3: one run


def _edge_body():
    bench = _bench()
    cfg = lambda **t: bench.layout_config("4,1,none", STEPS, **t)          # noqa: E731
    return {"fp32": bench._run(cfg(zero=0)), "perturbed": bench._run(cfg(zero=0), setup=bench._perturb(0)),
            "bf16 ZeRO-0": bench._run(cfg(zero=0, precision="bf16")),
            "bf16 ZeRO-3": bench._run(cfg(zero=3, precision="bf16"))}


@pytest.mark.wide
def test_bf16_at_the_edge_of_stability_as_close_as_fp32_perturbed_once():
    out = run_on_ranks(4, _edge_body, timeout=900)[0]
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
