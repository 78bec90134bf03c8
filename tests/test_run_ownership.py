"""Run-directory ownership and orphan workers (issue 21, items 3, 4, 10).

* A live run owns its run directory (``RUN_DIR/.gridshard.lock``, :mod:`gridshard.run_lock`): a
  second ``train`` into it — with or without ``--overwrite`` — is refused with exit 2 before launch,
  naming the live run's PID, and leaves the live run's files alone; a lock left by a dead job is
  taken over.
* Workers die with their launcher (:mod:`gridshard.parent_death`): SIGKILL of ``gridshard train``
  leaves no worker alive 10 s later and no checkpoint written after the kill.
* ``prepare-data --out`` refuses a non-empty folder unless ``--overwrite``, which replaces the
  preparation without leaving the old one's files; refusals (of ``train`` and ``prepare-data``)
  create nothing.

One real ``gridshard train`` subprocess (the live run, then killed); everything else in-process.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import gridshard.launch
from gridshard import run_lock
from gridshard.cli import EXIT_CONFIG, main

EXE = os.path.join(os.path.dirname(sys.executable), "gridshard")
LIVE_ARGS = ["--nproc", "2", "--no-progress", "parallel.data=2", "parallel.tensor=1", "data.seq_len=32", "data.max_bytes=100000",
             "train.steps=100000", "train.log_interval=1", "train.global_batch=4", "train.micro_batch=2",
             "train.save_interval=2", "model.layers=1", "model.hidden=32", "model.heads=2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started for a refused run")
    monkeypatch.setattr(gridshard.launch, "launch_local", boom)
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _train(*args):
    return CliRunner().invoke(main, ["train", *args])


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for PID 1 to reap it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" not in state.split()[1]
    except (OSError, StopIteration):
        return False


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _tree(folder) -> dict:
    """{relative path: size} of every file under ``folder``."""
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            out[os.path.relpath(path, folder)] = os.path.getsize(path)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_live_run_owns_its_directory_and_its_workers_die_with_its_launcher(tmp_path, no_launch, monkeypatch):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRIDSHARD_FAULT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([EXE, "train", "--run-dir", str(run), *LIVE_ARGS], stdout=log, stderr=log,
                                env=env, start_new_session=True)
    try:
        # the run is live once its first step is logged; its workers' PIDs are in their heartbeat files
        _wait_for(lambda: launcher.poll() is not None or (run / "metrics.jsonl").is_file(), 180, "the first step")
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
        workers = {}
        for rank in (0, 1):
            stamp, pid, host = (run / "logs" / f"heartbeat_rank_{rank}").read_text().split()[:3]
            workers[rank] = int(pid)
        assert all(_alive(p) for p in workers.values())
        holder = json.loads((run / run_lock.LOCK_FILE).read_text())
        assert holder["pid"] == launcher.pid and holder["host"]

        # a second train into the live run: refused before launch, naming its PID; nothing touched
        # (the live run itself rewrites heartbeats, saves and prunes checkpoints meanwhile)
        lock_text = (run / run_lock.LOCK_FILE).read_text()
        metrics_lines = len((run / "metrics.jsonl").read_text().splitlines())
        for extra in ([], ["--overwrite"], ["--resume", "latest"]):
            result = _train("--run-dir", str(run), *extra, "--no-progress")
            assert result.exit_code == EXIT_CONFIG, (extra, result.output, result.exception)
            assert result.output.count("config error:") == 1, result.output
            assert f"PID {launcher.pid}" in result.output and "Fix:" in result.output, result.output
            if extra == ["--overwrite"]:
                assert "never" in result.output, result.output
        assert (run / run_lock.LOCK_FILE).read_text() == lock_text
        assert len((run / "metrics.jsonl").read_text().splitlines()) >= metrics_lines
        for kept in ("config.yaml", "checkpoints", "logs/heartbeat_rank_0", "logs/heartbeat_rank_1"):
            assert (run / kept).exists(), kept

        # SIGKILL of the launcher: every worker ends within 10 s (the old code's orphans trained on,
        # wrote off-schedule checkpoints and moved `latest`); nothing changes in checkpoints/ after
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in workers.values()):
            time.sleep(0.2)
        alive = [r for r, p in workers.items() if _alive(p)]
        assert not alive, f"ranks {alive} outlived their killed launcher"
        checkpoints = _tree(run / "checkpoints")
        time.sleep(1)
        assert _tree(run / "checkpoints") == checkpoints
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)       # the old code's orphans share its process group
        except ProcessLookupError:
            pass
        launcher.wait(timeout=30)
        log.close()

    # the dead run's lock file is stale: a new run takes the directory over (here with --overwrite)
    assert (run / run_lock.LOCK_FILE).is_file()
    assert run_lock.live_holder(str(run)) is None
    launched = []
    monkeypatch.setattr(gridshard.launch, "launch_local", lambda *a, **k: launched.append(a) or {0: [1.0]})
    result = _train("--run-dir", str(run), "--overwrite", "--no-progress")
    assert result.exit_code == 0, result.output
    assert launched and not (run / "metrics.jsonl").exists()
    assert not (run / run_lock.LOCK_FILE).exists()           # released at the end of the command


def test_the_lock_in_process(tmp_path):
    """Held: a second acquire and the probe name the holder; released: free again and the file
    is gone; a file left by a dead process (no flock on it) is taken over."""
    run = str(tmp_path)
    assert run_lock.live_holder(run) is None
    lock = run_lock.acquire(run, wait_s=0)
    try:
        holder = run_lock.live_holder(run)
        assert holder["pid"] == os.getpid() and holder["host"]
        with pytest.raises(run_lock.ConfigError, match=rf"PID {os.getpid()} on .*Fix:"):
            run_lock.acquire(run, wait_s=0.2)
    finally:
        lock.release()
    assert run_lock.live_holder(run) is None and not os.path.exists(run_lock.lock_path(run))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(run_lock.lock_path(run), "w") as f:
        json.dump({"pid": dead.pid, "host": "elsewhere", "started": 0}, f)
    assert run_lock.live_holder(run) is None
    with run_lock.acquire(run, wait_s=0) as lock:
        assert json.loads(open(run_lock.lock_path(run)).read())["pid"] == os.getpid()


def test_without_flock_the_pid_decides(tmp_path, monkeypatch):
    """On a file system without flock (ENOLCK): a live PID on this host holds the directory, a dead
    one does not."""
    import errno

    def no_flock(*a):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    run = str(tmp_path)
    lock = run_lock.acquire(run, wait_s=0)
    assert run_lock.live_holder(run)["pid"] == os.getpid()
    with pytest.raises(run_lock.ConfigError, match=rf"PID {os.getpid()}"):
        run_lock.acquire(run, wait_s=0)
    lock.release()
    assert not os.path.exists(run_lock.lock_path(run))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    with open(run_lock.lock_path(run), "w") as f:
        json.dump({"pid": dead.pid, "host": socket.gethostname(), "started": 0}, f)
    run_lock.acquire(run, wait_s=0).release()


def test_refused_train_creates_nothing(tmp_path, no_launch):
    """A refusal after the run-directory check (a checkpoint to resume that is not one) used to
    leave an empty run folder behind; --check neither creates the folder nor takes a lock."""
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    run = tmp_path / "new" / "run"
    result = _train("--run-dir", str(run), f"train.resume={empty}", "--no-progress")
    assert result.exit_code == EXIT_CONFIG, (result.output, result.exception)
    assert not (tmp_path / "new").exists()
    result = _train("--run-dir", str(run), "train.lr=-1", "--no-progress")
    assert result.exit_code == EXIT_CONFIG and not (tmp_path / "new").exists()
    result = _train("--run-dir", str(run), "--check")
    assert result.exit_code == 0 and not (tmp_path / "new").exists(), result.output
    # an existing run without --resume/--overwrite: refused, nothing added (no lock file either)
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    result = _train("--run-dir", str(run), "--no-progress")
    assert result.exit_code == EXIT_CONFIG and sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("use_prctl", [True, False], ids=["pdeathsig", "watchdog"])
def test_a_worker_dies_with_its_parent(tmp_path, use_prctl):
    """A middle process M starts a child C that calls die_with_parent(M); SIGKILL of M ends C
    within seconds, by PR_SET_PDEATHSIG or, without it, the parent-PID watchdog. And a child whose
    launcher is already gone when it starts ends at once (the race before the prctl)."""
    module = os.path.join(ROOT, "gridshard", "parent_death.py")
    load = ("import importlib.util, os, sys, time; spec = importlib.util.spec_from_file_location('pd', "
            f"{module!r}); pd = importlib.util.module_from_spec(spec); spec.loader.exec_module(pd); ")
    child = load + f"pd.die_with_parent(int(sys.argv[1]), use_prctl={use_prctl}); time.sleep(60)"
    middle = ("import os, subprocess, sys, time; "
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); "
              "print(c.pid, flush=True); time.sleep(60)")
    m = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        c_pid = int(m.stdout.readline())
        time.sleep(0.5)                               # C has armed itself (it imports nothing heavy)
        assert _alive(c_pid)
        os.kill(m.pid, signal.SIGKILL)
        m.wait()
        _wait_for(lambda: not _alive(c_pid), 5, "the child of a killed parent to end")
    finally:
        try:
            os.killpg(m.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    late = subprocess.run([sys.executable, "-c", child, str(gone.pid)], timeout=30)
    assert late.returncode == -signal.SIGKILL


def _prepare(*args):
    return CliRunner().invoke(main, ["prepare-data", *args, "--no-progress", "--workers", "1"])


def test_prepare_data_refuses_a_non_empty_out_and_overwrites_cleanly(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 50)
    out = tmp_path / "data"
    out.mkdir()
    (out / "tokenizer.json").write_text("old tokenizer")         # an earlier BPE preparation
    (out / "meta.json").write_text('{"old": true}')
    (out / "tokens.bin").write_bytes(b"\0" * 10)
    (out / "notes.txt").write_text("mine")
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    result = _prepare(str(text), "--out", str(out), "--bytes")
    assert result.exit_code == EXIT_CONFIG, (result.output, result.exception)
    assert "--overwrite" in result.output and "Fix:" in result.output and str(out) in result.output
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    # --overwrite: the byte preparation replaces the BPE one; no old tokenizer.json beside it; notes kept
    result = _prepare(str(text), "--out", str(out), "--bytes", "--overwrite")
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(os.listdir(out)) == ["doc_starts.npy", "meta.json", "notes.txt", "tokens.bin"]
    from gridshard.data.prepare import prepared_tokenizer, read_meta

    assert read_meta(str(out))["n_tokens"] == 600 and prepared_tokenizer(str(out)).vocab_size == 256
    assert (out / "notes.txt").read_text() == "mine"
    # refusals create nothing: a missing input, and a failure after the work began (BPE too small)
    fresh = tmp_path / "x" / "fresh"
    assert _prepare(str(tmp_path / "missing"), "--out", str(fresh)).exit_code == EXIT_CONFIG
    result = _prepare(str(text), "--out", str(fresh), "--train-tokenizer", "--vocab-size", "10")
    assert result.exit_code == EXIT_CONFIG and "too small" in result.output, result.output
    assert not (tmp_path / "x").exists()
    # ... and a failed --overwrite leaves the previous preparation as it was
    kept = _tree(out)
    result = _prepare(str(text), "--out", str(out), "--train-tokenizer", "--vocab-size", "10", "--overwrite")
    assert result.exit_code == EXIT_CONFIG and _tree(out) == kept
