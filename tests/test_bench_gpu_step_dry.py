"""The GPU step benchmark's CPU dry run (issue 44): ``GPU_CHECK_DRY=1 python
benchmarks/bench_gpu_step.py`` runs every child of the device run — gridshard's step compiled and
eager, the plain transformers loop, the profiler reading, the emulated published layouts — with
tiny shapes on the CPU, so the script a lent device gets is known to run. Wide only (``make
test-all``): about two minutes of child processes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.wide
def test_bench_gpu_step_dry_run_measures_every_child(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_gpu_step.py"), "--skip", "1b"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["bench_gpu_step.json", "bench_gpu_step.md"]
    res = json.loads((tmp_path / "bench_gpu_step.json").read_text())
    runs = ["ours_3b_compile", "plain_3b", "ours_3b_eager", "profile_3b", "emulate_0", "emulate_1", "emulate_2"]
    assert {r: res[r]["status"] for r in runs} == dict.fromkeys(runs, "ok")
    ours, plain = res["ours_3b_compile"], res["plain_3b"]
    assert (plain["batch"], plain["recompute"]) == (ours["batch"], ours["recompute"])       # the same work
    assert ours["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0 and ours["predicted_bytes"] > 0
    assert res["profile_3b"]["top"] and res["profile_3b"]["gaps"] == "skipped: no CUDA"
    for i in range(3):
        assert [r["rank"] for r in res[f"emulate_{i}"]["ranks"]][0] == 0
        assert all(r["predicted_peak_bytes"] > 0 for r in res[f"emulate_{i}"]["ranks"])
    md = (tmp_path / "bench_gpu_step.md").read_text()
    assert "ours ÷ plain step" in md and "compile ÷ eager step" in md and "GPU_CHECK_DRY=1 python" in md
