"""End to end: the real `gridshard` command starts 2 elastic workers, trains a few steps,
writes metrics.jsonl (every key on every line) and config.yaml; `gridshard plot` writes PNGs."""
import json
import os
import subprocess
import sys

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_share", "peak_mem_bytes"}


def test_train_two_workers_then_plot(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "gridshard")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [exe, "train", "--nproc", "2", "--run-dir", str(run_dir), "--no-progress", "parallel.data=1",
         "parallel.tensor=2", "parallel.tensor_mode=1d", "parallel.sequence_parallel=true", "data.seq_len=32",
         "data.max_bytes=100000", "train.steps=6", "train.log_interval=2", "train.global_batch=4",
         "train.micro_batch=2"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 6 steps" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == [2, 4, 6]
    for rec in lines:
        assert REQUIRED <= set(rec), REQUIRED - set(rec)
        assert rec["loss"] > 0 and rec["tokens_per_s"] > 0 and rec["peak_mem_bytes"] > 0
    cfg = (run_dir / "config.yaml").read_text()
    assert "sequence_parallel: true" in cfg and "steps: 6" in cfg

    out = tmp_path / "plots"
    proc = subprocess.run([exe, "plot", str(run_dir), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
