"""Checkpoints through the real command line: a worker killed (SIGKILL) during training or in
the middle of a save, ``--max-restarts``, ``--resume``, ``gridshard export`` to Hugging Face,
and ``model.init_from``.

Kills come from ``GRIDSHARD_FAULT`` (:mod:`gridshard.checkpoint.faults`): the named rank
SIGKILLs itself at a named point, exactly like an OOM kill, in the first attempt only.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from gridshard.checkpoint.reader import read_checkpoint
from gridshard.engine import Trainer
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

EXE = os.path.join(os.path.dirname(sys.executable), "gridshard")
ARGS = ["--nproc", "2", "--no-progress", "parallel.data=1", "parallel.tensor=2", "parallel.tensor_mode=1d",
        "data.seq_len=32", "data.max_bytes=100000", "train.steps=8", "train.log_interval=1", "train.global_batch=4",
        "train.micro_batch=2", "train.save_interval=3"]


def _gridshard(args, fault=None, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "GRIDSHARD_FAULT"):
        env.pop(k, None)
    if fault:
        env["GRIDSHARD_FAULT"] = fault
    t0 = time.perf_counter()
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.perf_counter() - t0


def _metrics(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("cli") / "uninterrupted")
    proc, _ = _gridshard(["train", "--run-dir", run_dir, *ARGS])
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_killed_worker_ends_the_job_naming_the_rank(tmp_path, uninterrupted):
    run_dir = str(tmp_path / "killed")
    proc, seconds = _gridshard(["train", "--run-dir", run_dir, *ARGS], fault="step:1:5")
    assert proc.returncode == 1 and seconds < 60, (proc.returncode, seconds)
    assert "rank 1 died (SIGKILL)" in proc.stderr, proc.stderr[-3000:]
    assert f"last complete checkpoint: {os.path.join(run_dir, 'checkpoints', 'step_3')}" in proc.stderr
    # ... and --resume latest continues it to the uninterrupted run's losses and parameters, bit for bit
    proc, _ = _gridshard(["train", "--run-dir", run_dir, "--resume", "latest", *ARGS])
    assert proc.returncode == 0, proc.stderr
    assert _metrics(run_dir) == _metrics(uninterrupted)          # one run's file: steps 1-3 kept, 4-8 appended
    _assert_same_final_weights(run_dir, uninterrupted)


def test_kill_during_a_save_then_elastic_restart_resumes(tmp_path, uninterrupted):
    """Rank 1 dies after writing its chunks of step 6 (rank 0's save still open): the restart
    finds step_3 as latest, resumes and finishes equal to the uninterrupted run."""
    run_dir = str(tmp_path / "restarted")
    proc, _ = _gridshard(["train", "--run-dir", run_dir, "--max-restarts", "1", *ARGS], fault="save_after_data:1:6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_3 at step 3" in proc.stderr
    assert _metrics(run_dir) == _metrics(uninterrupted)
    _assert_same_final_weights(run_dir, uninterrupted)


def _assert_same_final_weights(run_dir, reference):
    a = read_checkpoint(os.path.join(run_dir, "checkpoints", "step_8"))[1]
    b = read_checkpoint(os.path.join(reference, "checkpoints", "step_8"))[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_model_is_refused_before_workers_start(uninterrupted):
    proc, seconds = _gridshard(["train", "--run-dir", uninterrupted, "--resume", "latest", *ARGS, "model.hidden=128"])
    assert proc.returncode == 2, proc.stderr
    assert "model.hidden is 128 in this config but 64 in the checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- export to Hugging Face, and back in ----------------------------------------------------------
MODEL = {"preset": None, "vocab_size": 300, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 96,
         "max_seq_len": 64}
CFG_2D = {"model": MODEL, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
          "parallel": {"data": 1, "tensor": 4, "tensor_mode": "2d"},
          "train": {"global_batch": 4, "micro_batch": 4, "steps": 3, "log_interval": 1, "lr": 3e-3}}


def _train_2d_body(run_dir):
    trainer = Trainer(CFG_2D, run_dir=run_dir, progress=False)
    trainer.run()
    state = gathered_state_dict(trainer.model)
    return state if dist.get_rank() == 0 else None


def _init_from_body(cfg):
    trainer = Trainer(cfg, progress=False)
    state = gathered_state_dict(trainer.model)
    return state if dist.get_rank() == 0 else None


def test_export_to_hf_loads_in_transformers_with_the_same_logits(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from gridshard.models import Transformer
    from gridshard.models.llama import ModelConfig

    run_dir = str(tmp_path / "run2d")
    state = run_on_ranks(4, _train_2d_body, run_dir, timeout=240)[0]
    out = str(tmp_path / "hf")
    proc, _ = _gridshard(["export", os.path.join(run_dir, "checkpoints"), "--to", "hf", out])
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer.json", "tokenizer_config.json"]

    hf = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = Transformer(ModelConfig(**{k: v for k, v in MODEL.items() if k != "preset"}))
    ours.load_state_dict(state)
    ours.eval()
    tokens = torch.randint(0, MODEL["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, got = ours(tokens), hf(input_ids=tokens).logits
    assert (got - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max())

    # model.init_from=OUT at another layout starts from exactly these weights
    cfg = {**CFG_2D, "model": {**MODEL, "init_from": out},
           "parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d", "sequence_parallel": True},
           "train": {**CFG_2D["train"], "micro_batch": 2}}
    loaded = run_on_ranks(4, _init_from_body, cfg, timeout=240)[0]
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
