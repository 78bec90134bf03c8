"""The composer and the step: ``gridshard.build_job(config)`` composes a job in its documented
order (gridshard/engine/job.py), and a plain loop of ``gridshard.train_step(job, job.batch(k))``
gives ``Trainer.run``'s losses, weights and validation loss bit for bit (same process, same
config), without and with pipeline stages; a config resolved by the launcher is used as it is.

The trainer is the reference here because its run is what every layout-equivalence test
already holds against one process (tests/test_train_equivalence.py, tests/test_pipeline.py):
the step loop must reproduce it exactly, not approximately."""
import inspect

import pytest
import torch
import torch.distributed as dist

import gridshard
from gridshard.engine import Trainer
from gridshard.engine import job as job_module
from gridshard.engine.job import COMPOSITION_ORDER, ResolvedConfig
from gridshard.engine.step import evaluate, global_losses
from gridshard.errors import ConfigError
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny", "layers": 2},
        "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000, "val_fraction": 0.1},
        "train": {"global_batch": 4, "micro_batch": 1, "steps": 3, "lr": 3e-3, "warmup_steps": 1, "grad_clip": 0.5,
                  "log_interval": 2, "eval_batches": 1, "seed": 5}}


def _cfg(pipeline: int) -> dict:
    return {**BASE, "parallel": {"data": 1, "pipeline": pipeline, "tensor": 1, "tensor_mode": "none",
                                 "pipeline_schedule": "1f1b"}}


def _whole_state(model, mesh) -> dict:
    """The canonical tensors of the whole model, merged over pipeline ranks."""
    state = gathered_state_dict(model)
    if mesh.pipeline.size == 1:
        return state
    parts = [None] * mesh.pipeline.size
    dist.all_gather_object(parts, state, group=mesh.pipeline.group)
    return {k: v for part in parts for k, v in part.items()}


def _recorded_order(cfg, run_dir):
    """Build a job with each stage's callable in gridshard.engine.job wrapped to record its call."""
    calls, saved = [], {}
    stages = {"Transformer": "model on meta", "pipeline_rank_model": "stage split", "parallelize": "parallelize",
              "apply_recompute": "recompute", "apply_compile": "compile", "build_reducer": "reducer",
              "build_optimizer": "optimizer", "Checkpointer": "checkpointer"}

    def recording(original, stage):
        return lambda *a, **k: calls.append(stage) or original(*a, **k)

    for name, stage in stages.items():
        saved[name] = getattr(job_module, name)
        setattr(job_module, name, recording(saved[name], stage))
    try:
        job = gridshard.build_job({**cfg, "train": {**cfg["train"], "compile": True}}, run_dir=run_dir)
    finally:
        for name, original in saved.items():
            setattr(job_module, name, original)
    job.checkpointer.close()
    return calls, job.composed


def _body(cfg, run_dir):
    trainer = Trainer(cfg, progress=False)
    run_losses = trainer.run()
    job = gridshard.build_job(cfg)
    results = [gridshard.train_step(job, job.batch(k)) for k in range(job.start_step, cfg["train"]["steps"])]
    step_losses = global_losses(job, [(r.loss_share, r.valid_targets) for r in results])
    ran, stepped = _whole_state(trainer.model, trainer.mesh), _whole_state(job.model, job.mesh)
    same_state = ran.keys() == stepped.keys() and all(torch.equal(ran[k], stepped[k]) for k in ran)
    order = _recorded_order(cfg, run_dir) if cfg["parallel"]["pipeline"] > 1 else None
    return (run_losses, step_losses, trainer.history[-1]["val_loss"], evaluate(job), same_state,
            [r.lr for r in results], [h["lr"] for h in trainer.history], order)


@pytest.mark.parametrize("pipeline", [1, 2], ids=["one-rank", "P2-pipelined"])
def test_train_step_loop_is_trainer_run_bit_for_bit(pipeline, tmp_path):
    out = run_on_ranks(pipeline, _body, _cfg(pipeline), str(tmp_path))
    for run_losses, step_losses, run_val, step_val, same_state, lrs, logged_lrs, order in out:
        assert len(run_losses) == BASE["train"]["steps"] and all(x is not None for x in run_losses)
        assert step_losses == run_losses                       # exactly, not approximately
        assert step_val == run_val is not None                 # evaluation through the same driver
        assert same_state                                      # and the same weights after the run
        assert lrs[1] == logged_lrs[0] and lrs[-1] == logged_lrs[-1]      # the schedule read from batch.step
        if order is not None:                                  # every stage runs, once, in the documented order
            calls, composed = order
            assert calls == list(COMPOSITION_ORDER) == composed, calls


def _resolved_body(cfg):
    from gridshard.config import resolve_config

    resolved = ResolvedConfig(resolve_config(cfg, world_size=1, cuda_available=False), 1, False)
    original = job_module.resolve_config

    def refuse(*a, **k):
        raise AssertionError("the resolved config was resolved again")

    job_module.resolve_config = refuse
    try:
        job = gridshard.build_job(resolved)
        with pytest.raises(ConfigError, match=r"resolved for 2 process\(es\).*Fix:"):
            gridshard.build_job(ResolvedConfig(resolved.config, 2, False))
    finally:
        job_module.resolve_config = original
    return job.cfg is resolved.config


def test_a_resolved_config_is_not_resolved_again():
    assert run_on_ranks(1, _resolved_body, _cfg(1)) == [True]


def test_public_names():
    for name in ("build_job", "train_step"):
        assert name in gridshard.__all__ and (getattr(gridshard, name).__doc__ or "").strip()
    assert list(inspect.signature(gridshard.parallelize).parameters) == [
        "model", "mesh", "plan", "sequence_parallel", "seed", "device", "summa_overlap", "overlap_input_grad",
        "context_mode", "expert_dispatch"]
