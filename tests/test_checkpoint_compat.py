"""A checkpoint written by gridshard before the trust and redesign work (main at 3970def) still
loads, bit for bit, through today's verifying reader and resume path.

``tests/data/checkpoint_before_redesign/step_2`` was written by that commit (the command is in
``expected.json``: a 1-layer tied GQA model at D=1, T=2 1D, 4 steps, saved at step 2); the
same file holds the sha256 of every tensor as that commit's reader returned it and the losses of
the uninterrupted run. The checkpoint has no ``weights_finite`` field in its ``meta.json`` and its
config lacks the keys added since (``train.on_nonfinite``, ``train.allow_changed_schedule``):
both must be accepted.
"""
import hashlib
import json
import os
import shutil

import torch.distributed as dist

from gridshard.checkpoint.reader import read_checkpoint
from gridshard.engine import Trainer
from gridshard.testing import run_on_ranks

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "checkpoint_before_redesign")


def _expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


def _sha(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_the_old_checkpoint_reads_bit_for_bit():
    want = _expected()["tensor_sha256"]
    folder = os.path.join(FIXTURE, "step_2")
    got = {}
    for prefix in ("model.", "optim."):
        _, tensors = read_checkpoint(folder, prefix)
        got.update({prefix + k: _sha(v) for k, v in tensors.items()})
    assert got == want


def _resume_body(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        cfg = json.load(f)["config"]
    cfg["train"]["resume"] = folder
    losses = Trainer(cfg, progress=False).run()
    return losses if dist.get_rank() == 0 else None


def test_resuming_the_old_checkpoint_continues_the_old_run_exactly(tmp_path):
    folder = str(tmp_path / "checkpoints" / "step_2")
    shutil.copytree(os.path.join(FIXTURE, "step_2"), folder)
    losses = run_on_ranks(2, _resume_body, folder, timeout=240)[0]
    old = _expected()["losses"]
    assert losses == [old["3"], old["4"]]
