"""A diverged run never replaces good checkpoints, and a disk that cannot take a checkpoint
says so in one line (issue 21, items 5 and 7).

* ``train.lr=1e9``: the global gradient norm is NaN at step 2; with ``train.on_nonfinite=stop``
  (the default) every rank raises :class:`NonFiniteError` at that step, before its update, and
  ``latest`` names the finite step-1 checkpoint (before: the run ended "fine", saved NaN
  checkpoints, moved ``latest`` to them and pruned the good ones);
* ``on_nonfinite=skip``: the update of such a step is dropped — the weights stay exactly what
  they were —, counted in ``skipped_steps``;
* fp16: the loss scaler's overflow skip is untouched; a non-finite *loss* is divergence;
* the save itself refuses NaN weights on any rank (the others agree) and prune keeps the
  newest finite checkpoint;
* a save that fails with ENOSPC / EROFS: one line naming the cause and the last complete
  checkpoint, on every rank; no ``.partial`` left; the previous checkpoint still verifies;
* a real ``gridshard train`` on a 3 MB tmpfs (skipped where mounting is not permitted).
"""
import errno
import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gridshard.checkpoint import Checkpointer, FaultPlan, read_latest, verify_checkpoint
from gridshard.checkpoint.files import checkpoints_root, prune
from gridshard.checkpoint.reader import read_checkpoint
from gridshard.engine import Trainer
from gridshard.errors import NonFiniteError, SaveError
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "parallel": {"data": 1, "tensor": 2, "tensor_mode": "1d"},
        "train": {"global_batch": 4, "micro_batch": 4, "steps": 6, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 0,
                  "log_interval": 1, "seed": 11}}


def _cfg(**train):
    return {**BASE, "train": {**BASE["train"], **train}}


def _all_finite(folder):
    tensors = {**read_checkpoint(folder, "model.")[1], **read_checkpoint(folder, "optim.")[1]}
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


# ---- train.on_nonfinite=stop ---------------------------------------------------------------------
def _diverge_body(run_dir):
    trainer = Trainer(_cfg(lr=1e9, save_interval=1, keep_checkpoints=1), run_dir=run_dir, progress=False)
    try:
        trainer.run()
    except NonFiniteError as e:
        return str(e), [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.history]
    return None, [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.history]


def test_lr_1e9_stops_at_the_first_nonfinite_norm_and_latest_stays_finite(tmp_path):
    out = run_on_ranks(2, _diverge_body, str(tmp_path), timeout=240)
    message, history = out[0]
    assert message is not None, f"the run did not stop: {history}"
    assert out[1][0] == message                                     # every rank, the same error
    # step 1 was finite (logged), step 2's norm is the first non-finite value: stopped there
    assert [s for s, _, _ in history] == [1] and all(map(lambda x: x == x and abs(x) < 1e30, history[0][1:]))
    assert message.startswith("step 2: the global gradient norm is nan") and "\n" not in message
    root = checkpoints_root(str(tmp_path))
    assert f"last finite checkpoint: {os.path.join(root, 'step_1')}" in message and "train.lr=1e+09" in message
    assert sorted(os.listdir(root)) == ["latest", "step_1"]       # keep_checkpoints=1 did not prune it
    assert read_latest(root) == os.path.join(root, "step_1")
    verify_checkpoint(os.path.join(root, "step_1"))
    assert _all_finite(os.path.join(root, "step_1"))


# ---- train.on_nonfinite=skip ---------------------------------------------------------------------
def _skip_body(run_dir):
    trainer = Trainer(_cfg(lr=1e9, steps=3, on_nonfinite="skip"), run_dir=run_dir, progress=False)
    trainer.step(0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = [(s["step"].clone(), s["exp_avg"].clone()) for s in trainer.optimizer.state.values()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, norm, _ = trainer.step(1)
    same = all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    same_moments = all(torch.equal(s["step"], a) and torch.equal(s["exp_avg"], b)
                       for s, (a, b) in zip(trainer.optimizer.state.values(), moments))
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    said = [str(w.message) for w in caught if "skipped" in str(w.message)]
    trainer.checkpointer.close()
    return float(norm), same, same_moments, finite, trainer.skipped_steps, said


def test_skip_drops_the_update_of_a_nonfinite_step(tmp_path):
    out = run_on_ranks(2, _skip_body, str(tmp_path), timeout=240)
    norm, same, same_moments, finite, skipped, said = out[0]
    assert norm != norm                                          # the step's norm was NaN...
    assert same and same_moments and finite                      # ...and nothing of it reached the weights
    assert skipped == 1 and out[1][4] == 1
    assert len(said) == 1 and said[0].startswith("step 2: the global gradient norm is nan: its update was skipped")
    assert out[1][5] == []                                       # rank 0 warns, once


def _fp16_stub(on_nonfinite):
    """The parts of a Trainer that :meth:`Trainer._skip_nonfinite` reads, one process, fp16."""
    from gridshard.comm.ledger import CommLedger
    from gridshard.engine.precision import Precision

    one = SimpleNamespace(size=1)
    stub = Trainer.__new__(Trainer)
    stub.precision, stub.device, stub.rank = Precision("fp16", torch.device("cpu")), torch.device("cpu"), 0
    stub.mesh, stub.ledger = SimpleNamespace(data=one, data_context=one, pipeline=one), CommLedger()
    stub.cfg = SimpleNamespace(train=SimpleNamespace(on_nonfinite=on_nonfinite, lr=1e-3, grad_clip=1.0))
    stub.checkpointer, stub.resume_from, stub.skipped_steps, stub.skipped_recent = None, None, 0, set()
    return stub


def test_fp16_overflow_is_the_scalers_and_a_nonfinite_loss_is_divergence():
    inf, ok = torch.tensor(float("inf")), [torch.tensor(2.5)]
    stub = _fp16_stub("stop")
    assert stub._skip_nonfinite(0, torch.tensor(3.0), ok) is False
    assert stub._skip_nonfinite(0, inf, ok) is False and stub.skipped_steps == 0   # the scaler's overflow skip
    with pytest.raises(NonFiniteError, match=r"^step 4: the loss is not finite .*fp16"):
        stub._skip_nonfinite(3, inf, [torch.tensor(float("nan"))])
    stub = _fp16_stub("skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the scaler itself drops the update (found_inf): counted, not skipped twice
        assert stub._skip_nonfinite(3, inf, [torch.tensor(float("inf"))]) is False
    assert stub.skipped_steps == 1


# ---- the save refuses non-finite weights ---------------------------------------------------------
def _trainer_saved_at_step_1(run_dir, keep):
    """A 2-step trainer whose step 1 is checkpointed in ``run_dir`` and step 2 taken: (trainer, checkpointer)."""
    trainer = Trainer(_cfg(steps=2), run_dir=None, progress=False)
    trainer.step(0)
    ck = Checkpointer(run_dir, keep=keep)
    trainer.checkpointer = ck
    trainer.save_checkpoint(1, blocking=True)
    trainer.step(1)
    return trainer, ck


def _poisoned_save_body(run_dir):
    trainer, ck = _trainer_saved_at_step_1(run_dir, keep=1)
    if dist.get_rank() == 0:                         # one rank's block only: the others must agree
        with torch.no_grad():
            next(trainer.model.parameters()).view(-1)[0] = float("nan")
    error = None
    try:
        trainer.save_checkpoint(2, blocking=True)
    except NonFiniteError as e:
        error = str(e)
    ck.close()
    return error


def test_a_checkpoint_with_nan_weights_is_never_published(tmp_path):
    out = run_on_ranks(2, _poisoned_save_body, str(tmp_path), timeout=240)
    assert out[0] is not None and out[0] == out[1], out
    root = checkpoints_root(str(tmp_path))
    assert out[0].startswith("checkpoint step_2 refused: its block model.") and "(rank 0) holds NaN/inf" in out[0]
    assert f"last finite checkpoint: {os.path.join(root, 'step_1')}" in out[0] and "\n" not in out[0]
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    verify_checkpoint(os.path.join(root, "step_1"))


def test_prune_keeps_the_newest_finite_checkpoint(tmp_path):
    root = str(tmp_path)
    for step, finite in ((1, True), (2, False), (3, False)):
        folder = os.path.join(root, f"step_{step}")
        os.makedirs(folder)
        for name, obj in (("meta.json", {"step": step, "weights_finite": finite}), ("manifest.json", {"files": {}})):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(obj, f)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_3\n")
    prune(root, keep=1)
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]


# ---- disk errors while saving --------------------------------------------------------------------
def _disk_error_body(run_dir, code):
    trainer, ck = _trainer_saved_at_step_1(run_dir, keep=3)
    ck.faults = FaultPlan("save_after_data", 1, action="raise", errno=code)   # rank 1's chunks are on disk
    error = None
    try:
        trainer.save_checkpoint(2, blocking=True)
    except SaveError as e:
        error = str(e)
    ck.faults = None
    ck.close()
    return error


@pytest.mark.parametrize("code,says", [(errno.ENOSPC, "is full: "), (errno.EROFS, "is on a read-only file system")],
                         ids=["ENOSPC", "EROFS"])
def test_a_disk_error_while_saving_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, code, says):
    out = run_on_ranks(2, _disk_error_body, str(tmp_path), code, timeout=240)
    assert out[0] is not None and out[0] == out[1], out          # every rank, the same one line
    root = checkpoints_root(str(tmp_path))
    line = out[0]
    assert line.startswith(f"run dir {tmp_path} {says}") and "\n" not in line and "Traceback" not in line
    assert "checkpoint step_2 was not saved (its partial folder was removed)" in line
    assert f"last complete checkpoint: {os.path.join(root, 'step_1')}" in line and "Fix: " in line
    if code == errno.ENOSPC:
        assert "a checkpoint needs ~" in line and " MB" in line
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    verify_checkpoint(os.path.join(root, "step_1"))


def test_a_full_disk_while_appending_metrics_is_one_line(tmp_path):
    from gridshard.engine.metrics import RunFiles

    files = RunFiles(str(tmp_path), active=True)
    os.remove(files.metrics_path)
    os.symlink("/dev/full", files.metrics_path)                   # every write: ENOSPC
    with pytest.raises(SaveError) as caught:
        files.append({"step": 7, "loss": 1.0})
    line = str(caught.value)
    assert line.startswith(f"run dir {tmp_path} is full: ") and "step 7 was not appended to metrics.jsonl" in line
    assert "no complete checkpoint was written" in line and "\n" not in line


def test_the_rank_log_never_raises(tmp_path, capsys):
    from gridshard.cli import write_rank_log

    blocked = tmp_path / "a_file"
    blocked.write_text("")                                        # RUN_DIR/logs cannot be created under a file
    write_rank_log(str(blocked), 1, SaveError("run dir X is full: 0 B free"))
    err = capsys.readouterr().err
    assert err.startswith("gridshard: rank 1: SaveError: run dir X is full: 0 B free (its log ") and err.count("\n") == 1


# ---- a real run on a 3 MB tmpfs ------------------------------------------------------------------
EXE = os.path.join(os.path.dirname(sys.executable), "gridshard")


def test_a_run_on_a_3mb_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 3 MB tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        run = mnt / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for k in ("RANK", "WORLD_SIZE", "GRIDSHARD_FAULT", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(k, None)
        # the tiny model's checkpoint is ~1.7 MB on disk: step 1 fits, step 2 does not
        proc = subprocess.run([EXE, "train", "--nproc", "1", "--run-dir", str(run), "--no-progress",
                               "parallel.data=1", "parallel.tensor=1", "parallel.tensor_mode=none", "data.seq_len=32",
                               "data.max_bytes=200000", "train.global_batch=4", "train.micro_batch=4",
                               "train.steps=4", "train.save_interval=1", "train.log_interval=1"],
                              capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
        root = checkpoints_root(str(run))
        assert proc.returncode == 3, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        full = [x for x in proc.stderr.splitlines() if f"run dir {run} is full: " in x]
        assert full and full[0].startswith("training failed: rank 0: SaveError: run dir"), proc.stderr
        assert "a checkpoint needs ~" in full[0] and f"last complete checkpoint: {root}" in full[0]
        assert not [x for x in os.listdir(root) if x.endswith(".partial")], os.listdir(root)
        latest = read_latest(root)
        verify_checkpoint(latest)
        assert (run / "logs" / "rank_0.log").is_file()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
