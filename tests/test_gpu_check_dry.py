"""The GPU check's CPU dry run (issue 27): ``GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh`` runs
every step of the device check with tiny shapes over gloo, so the script cannot rot between
device loans. Wide only (``make test-all``): it launches ~10 training processes (~1 min)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADLINE = {"tokens_per_s", "mfu", "peak_mem_bytes", "host_syncs_after_step1", "compile_ratio", "recompiles"}


@pytest.mark.wide
def test_gpu_check_dry_run_writes_only_the_summary_and_metrics(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "PY": sys.executable}
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "summary.json"]      # no run dirs, no checkpoints
    summary = json.loads((out / "summary.json").read_text())
    assert HEADLINE <= summary.keys() and summary["dry"] is True and summary["failed"] == []
    assert summary["tokens_per_s"] > 0 and summary["peak_mem_bytes"] > 0
    assert summary["host_syncs_after_step1"] == "skipped: no CUDA"
    assert summary["recompiles"] <= 2 and summary["compile_ratio"] > 0
    checks = summary["checks"]
    assert checks["C_fp16"]["status"] == checks["G_sdpa"]["status"] == "skipped: no CUDA"
    assert checks["H_memory_snapshot"]["status"] == "skipped: no CUDA"
    assert checks["I_emulate"]["comm_bytes"]["data"] > 0 and checks["I_emulate"]["predicted_peak_bytes"] > 0
    assert checks["J_document_masks"]["kernels"] == "skipped: no CUDA" and checks["J_document_masks"]["mask_step_ratio"] > 0
    assert checks["E_offload"]["max_loss_rel_diff"] <= 1e-3
    assert checks["F_resume"]["resumed_from"] == "step_5"
    assert checks["F_resume"]["max_loss_rel_diff_steps_6_10"] <= 0.01
    tagged = {json.loads(line)["check"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {"A_bf16", "B_compile", "D_fp32", "E_offload", "F_first", "F_resumed", "J_packed", "M_D2"} <= tagged
    assert "loss" in checks["multi_gpu"]["M_D2"]
