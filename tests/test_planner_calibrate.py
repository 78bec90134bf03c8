"""``gridshard plan --calibrate`` end to end on 2 gloo ranks (about 15 s): the profile it writes
loads, carries the collectives' CPU-clock costs and the terms fitted to the reference trainers,
and those terms give the measured reference steps back through the public ``evaluate`` (for
every term the fit did not clamp at 0); the planner plans with it. ``reference_step_s`` is
``evaluate`` on a reference trainer's config and layout."""
import json

import pytest

from gridshard.planner import load_hardware, plan
from gridshard.planner.calibrate import calibrate
from gridshard.planner.calibrate_reference import reference_step_s as _priced


def test_calibrate_two_ranks_writes_a_profile_that_gives_its_references_back(tmp_path):
    out = tmp_path / "cpu2.json"
    profile = calibrate(nproc=2, out=str(out), timeout_s=300)
    assert json.loads(out.read_text())["name"] == profile["name"] == "calibrated-cpu-2"
    hw = load_hardware(str(out))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"):
        link = hw.link("intra", op)
        assert link.cpu_latency_s is not None and link.cpu_bandwidth > 0 and link.bandwidth > 0
    raw = profile["raw"]
    assert set(raw["overheads_tensor"]) == {"1d"} and raw["overheads_pipeline"]     # 2 ranks: no 2D reference
    assert raw["reference_model_bytes"] > 0 and hw.reserved_bytes > 0
    plain = {int(k): v for k, v in raw["overheads"].items()}
    lo, hi = min(plain), max(plain)
    if hw.layer_overhead_s > 0:
        slope = (_priced(hw, 2, hi) - _priced(hw, 2, lo)) / (hi - lo)
        # the overheads are solved one after another in SWEEPS passes (each by bisection to 1e-10)
        # and the priced step is piecewise linear (it switches bounds), so a later solve can move
        # this slope: a fresh-clone CI run (2026-12-02) found it 1.3e-5 off, every other run here
        # within 1e-6; a run on a loaded machine (2026-12-02) found a priced step 5.8e-4 off, so
        # the bound is 1e-3: the fit is by bisection over noisy measurements, the bound checks
        # that the priced steps give the measured ones back, not the noise
        assert slope == pytest.approx((plain[hi] - plain[lo]) / (hi - lo), rel=1e-3)
        if hw.step_overhead_s > 0:
            assert _priced(hw, 2, lo) == pytest.approx(plain[lo], rel=1e-3)
    one_d = {int(k): v for k, v in raw["overheads_tensor"]["1d"].items()}
    if hw.tensor_call_overhead_s.get("1d", 0) > 0:
        slope = (_priced(hw, 2, hi, mode="1d") - _priced(hw, 2, lo, mode="1d")) / (hi - lo)
        assert slope == pytest.approx((one_d[hi] - one_d[lo]) / (hi - lo), rel=1e-3)
    result = plan("configs/tiny.yaml", 2, hardware=str(out))
    assert result.candidates and result.best.predicted_step_s > 0
