"""Everything checkable before workers start is refused with exit 2 and one message naming
the value, the rule and a fix — and no worker is started (``launch_local`` replaced by a trap)."""
import os
import time

import numpy as np
import pytest
from click.testing import CliRunner

import gridshard.launch
from gridshard.cli import EXIT_CONFIG, main


@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started for a refused run")
    monkeypatch.setattr(gridshard.launch, "launch_local", boom)
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


def _refused(args, *words):
    t0 = time.perf_counter()
    result = CliRunner().invoke(main, ["train", *args])
    assert result.exit_code == EXIT_CONFIG, (result.exit_code, result.output, result.exception)
    assert result.output.count("config error:") == 1 and "Fix:" in result.output, result.output
    for w in words:
        assert w in result.output, (w, result.output)
    assert time.perf_counter() - t0 < 10
    return result.output


def test_existing_run_is_refused_unless_resumed_or_overwritten(tmp_path, no_launch, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _refused(["--run-dir", str(run)], "already holds a run", "metrics.jsonl", "--resume latest", "--overwrite")
    _refused(["--run-dir", str(run), "--overwrite", "train.resume=auto"], "--overwrite and --resume")
    # --overwrite removes gridshard's outputs, keeps the rest, then launches
    (run / "notes.txt").write_text("mine")
    launched = []
    monkeypatch.setattr(gridshard.launch, "launch_local", lambda *a, **k: launched.append(a) or {0: [1.0]})
    result = CliRunner().invoke(main, ["train", "--run-dir", str(run), "--overwrite", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert launched and sorted(os.listdir(run)) == ["notes.txt"]
    # an elastic restart (or train.resume=auto) continues the run: not refused
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert CliRunner().invoke(main, ["train", "--run-dir", str(run), "--no-progress"]).exit_code == 0
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert CliRunner().invoke(main, ["train", "--run-dir", str(run), "--no-progress",
                                     "train.resume=auto"]).exit_code == 0


def test_unwritable_run_dir(tmp_path, no_launch):
    (tmp_path / "a_file").write_text("")               # a folder below a file cannot be made, even by root
    _refused(["--run-dir", str(tmp_path / "a_file" / "run")], "is not writable", "--run-dir")


def test_warmup_longer_than_the_run(tmp_path, no_launch):
    _refused(["--run-dir", str(tmp_path / "r"), "train.steps=5", "train.warmup_steps=8"],
             "train.warmup_steps=8", "train.steps=5")


def test_token_id_beyond_the_vocabulary_anywhere_in_the_file(tmp_path, no_launch):
    ids = np.full(100_000, 7, dtype=np.uint16)
    ids[99_990] = 256                                  # far from any batch the first steps would read
    ids.tofile(tmp_path / "t.bin")
    _refused(["--run-dir", str(tmp_path / "r"), "data.kind=tokens", f"data.path={tmp_path / 't.bin'}"],
             "token id 256 at position 99990", "vocab_size=256")


def test_a_cluster_config_does_not_start_64_local_processes(tmp_path, no_launch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _refused([os.path.join(root, "configs", "llama_7b.yaml"), "--run-dir", str(tmp_path / "r")],
             "needs 64 processes", "torchrun", "--nproc 64")


def test_tensorboard_without_the_package_is_refused_with_the_extra_named(tmp_path, no_launch):
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    _refused(["--run-dir", str(tmp_path / "r"), "train.log_to=[jsonl, tensorboard]"],
             "train.log_to", "pip install -e .[tensorboard]")
