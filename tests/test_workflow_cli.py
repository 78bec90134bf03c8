"""The real commands, end to end at tiny sizes: prepare-data (trained BPE) on a folder of text →
train at D=2 × T=2 with validation → plot → generate; a worker that raises; Ctrl-C (a checkpoint
at the interrupt, resumed); a stalled (SIGSTOP) worker.

Each check reports exit code, message and time to exit; an interrupted job leaves no process."""
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time

EXE = os.path.join(os.path.dirname(sys.executable), "gridshard")
TINY = ["--no-progress", "data.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.log_interval=2"]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "GRIDSHARD_FAULT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    return env


def _run(args, timeout=240):
    t0 = time.perf_counter()
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, env=_env())
    return proc, time.perf_counter() - t0


def test_prepare_train_watch_generate(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    lib = sysconfig.get_paths()["stdlib"]
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py"):
        (text / (name + ".txt")).write_bytes(open(os.path.join(lib, name), "rb").read())
    data = tmp_path / "data"
    proc, _ = _run(["prepare-data", str(text), "--out", str(data), "--train-tokenizer", "--vocab-size", "400",
                    "--val-fraction", "0.1", "--workers", "2", "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((data / "meta.json").read_text())
    assert meta["documents"] == 4 and meta["vocab_size"] <= 400 and "MB/s" in proc.stdout

    run = tmp_path / "run"
    proc, _ = _run(["train", "--nproc", "4", "--run-dir", str(run), "parallel.data=2", "parallel.tensor=2",
                    "parallel.tensor_mode=1d", "data.kind=prepared", f"data.path={data}", "train.steps=6",
                    "train.eval_interval=3", "train.eval_batches=1", "train.warmup_steps=2", *TINY])
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 3, 4, 6]
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6] and all(r["val_loss"] > 0 for r in recs[1::2])
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["vocab_size"] == meta["vocab_size"]

    proc, _ = _run(["plot", str(run)])
    assert proc.returncode == 0, proc.stderr
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"

    # (the same seed gives the same text: tests/test_generate.py, in process)
    first, _ = _run(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "20", "--seed", "3"])
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def ") and len(first.stdout) > 10
    assert "step 6" in first.stderr

    # the same run directory again: refused before launch, exit 2, with the fixes named
    proc, took = _run(["train", "--nproc", "4", "--run-dir", str(run), "data.kind=prepared", f"data.path={data}"])
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "--resume latest" in proc.stderr
    assert took < 30


def test_a_worker_error_is_one_line_and_a_log(tmp_path):
    run = tmp_path / "run"
    proc, took = _run(["train", "--nproc", "2", "--run-dir", str(run), "parallel.data=2", "parallel.tensor=1",
                       "parallel.tensor_mode=none", f"model.init_from={tmp_path / 'nothing_here'}",
                       "train.steps=4", *TINY])
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("training failed: rank ") and "nothing_here" in first and "logs/rank_" in first, first
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    log = (run / "logs" / f"rank_{first.split()[3].rstrip(':')}.log").read_text()
    assert "Traceback (most recent call last)" in log
    assert took < 60


def _no_process_left(pgid):
    left = []
    for _ in range(50):                                   # workers, launcher helpers: none may outlive it
        left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True,
                              text=True).stdout.split("\n")
        left = [x for x in left if x.strip() and " Z" not in x]
        if not left:
            return
        time.sleep(0.1)
    assert not left, f"processes of the job are still alive: {left}"


def _start(args):
    return subprocess.Popen([EXE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _wait_for_steps(run, n, proc):
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert metrics.exists(), "training never logged"


def test_ctrl_c_stops_cleanly_with_a_checkpoint_that_resumes(tmp_path):
    from gridshard.checkpoint import verify_checkpoint

    run = tmp_path / "run"
    common = ["--nproc", "2", "--run-dir", str(run), "parallel.data=2", "parallel.tensor=1",
              "parallel.tensor_mode=none", "train.log_interval=3", *TINY[1:4]]
    proc = _start(["train", *common, "train.steps=100000"])
    _wait_for_steps(run, 1, proc)
    t0 = time.perf_counter()
    os.killpg(proc.pid, signal.SIGINT)                    # what Ctrl-C in a terminal does
    out, err = proc.communicate(timeout=60)
    took = time.perf_counter() - t0
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    found = re.search(r"stopped at step (\d+); checkpoint (\S+) \(resume with --resume latest", err)
    assert found, err
    step, folder = int(found[1]), run / "checkpoints" / f"step_{found[1]}"
    assert found[2] == str(folder), err
    assert took < 45                                      # the step, a blocking save, exit: ~5 s unloaded
    _no_process_left(proc.pid)
    # a checkpoint of exactly the completed steps, written at the interrupt (not a log step: interval 3)
    verify_checkpoint(str(folder))
    assert json.loads((folder / "meta.json").read_text())["step"] == step
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == step                       # the metrics are flushed up to the stop

    # --resume latest continues from it (fewer steps on the same schedule: the cosine still ends at 100000)
    proc, _ = _run(["train", *common, "--resume", "latest", f"train.steps={step + 2}", "train.decay_steps=100000"])
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {folder} at step {step}" in proc.stderr
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # logged after the resume: the multiples of log_interval=3 and the last step, right after the stop's record
    after = [s for s in (step + 1, step + 2) if s % 3 == 0 or s == step + 2]
    assert [r["step"] for r in recs[-len(after) - 1:]] == [step, *after]


def test_a_stalled_rank_is_named_and_killed(tmp_path):
    """SIGSTOP one worker mid-run: the others time out in a collective after
    train.collective_timeout_s; the job ends non-zero soon after, naming the stopped rank,
    and no process is left (the stopped one is killed)."""
    run = tmp_path / "run"
    timeout = 8
    proc = _start(["train", "--nproc", "2", "--run-dir", str(run), "parallel.data=2", "parallel.tensor=1",
                   "parallel.tensor_mode=none", "train.steps=100000", "train.log_interval=1",
                   f"train.collective_timeout_s={timeout}", *TINY[:4]])
    _wait_for_steps(run, 2, proc)
    pid = int((run / "logs" / "heartbeat_rank_1").read_text().split()[1])
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        out, err = proc.communicate(timeout=timeout + 60)
    finally:
        os.kill(pid, signal.SIGCONT) if proc.poll() is None else None
    took = time.perf_counter() - t0
    assert proc.returncode == 1, (proc.returncode, err)
    first = err.strip().splitlines()[0]
    assert first.startswith("training failed: rank 1 (silent for its last ") and "stopped answering" in first, err
    assert f"train.collective_timeout_s={timeout} s" in first and "rank 0 (silent" not in first, first
    assert "Traceback" not in err, err
    assert took < timeout + 15, took                      # the timeout, the agent's 5 s grace, start-up slack
    _no_process_left(proc.pid)


def test_stalled_ranks_are_those_whose_heartbeats_stopped_well_before_the_others(tmp_path):
    from gridshard.engine.control import heartbeat_path, stalled_ranks

    (tmp_path / "logs").mkdir()
    now = time.time()
    for rank, age in ((0, 0.5), (1, 11.0), (2, 0.0), (3, 2.5), (7, 99.0)):     # rank 7: an earlier, larger run
        with open(heartbeat_path(str(tmp_path), rank), "w") as f:
            f.write(f"{now - age:.3f} {1000 + rank} host\n")
    assert [r for r, _ in stalled_ranks(str(tmp_path), 4, timeout_s=8)] == [1]
    assert [r for r, _ in stalled_ranks(str(tmp_path), 4, timeout_s=30)] == []  # 11 s < 30 / 2: not yet
    assert stalled_ranks(str(tmp_path), 1, timeout_s=8) == []                   # nothing to compare with
