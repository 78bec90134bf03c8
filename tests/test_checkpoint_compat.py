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


ZERO_ROWS = os.path.join(os.path.dirname(__file__), "data", "zero2_row_shards")


def _zero_rows_body(folder, run_dir):
    with open(os.path.join(folder, "meta.json")) as f:
        cfg = json.load(f)["config"]
    cfg["train"].update(resume=folder, zero=3, micro_batch=1)
    cfg["parallel"]["data"] = 4
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.save_checkpoint(2, blocking=True)              # what was read, written again as element ranges
    losses = trainer.run()
    return losses if dist.get_rank() == 0 else None


def test_a_row_sharded_zero2_checkpoint_loads_into_element_ranges_bit_for_bit(tmp_path):
    """``tests/data/zero2_row_shards/step_2`` was written by the row-sharded ZeRO-2 at D=2 (commit
    220d612; the command is in ``expected.json``; vocabulary 257: padded rows). Resumed at ZeRO-3
    D=4, which keeps element ranges of per-layer flat buffers (cut inside rows: 2064 = 64.5 rows of
    the 257×32 table), every block is read by overlap with other chunks: written again right after
    the resume, every model tensor and AdamW moment is bit for bit the old one, and the run
    continues the old run."""
    want = json.load(open(os.path.join(ZERO_ROWS, "expected.json")))
    folder = str(tmp_path / "old" / "checkpoints" / "step_2")
    shutil.copytree(os.path.join(ZERO_ROWS, "step_2"), folder)
    losses = run_on_ranks(4, _zero_rows_body, folder, str(tmp_path / "new"), timeout=240)[0]
    again = os.path.join(str(tmp_path / "new"), "checkpoints", "step_2")
    got = {}
    for prefix in ("model.", "optim."):
        _, tensors = read_checkpoint(again, prefix)
        got.update({prefix + k: _sha(v) for k, v in tensors.items()})
    assert got == want["tensor_sha256"]
    for got_loss, step in zip(losses, ("3", "4")):                # D=4 sums the loss in another order
        assert abs(got_loss - want["losses"][step]) / want["losses"][step] < 1e-6, (losses, want["losses"])
