"""What the 2.5D and 3D model tests (:mod:`tests.test_tp2p5d_model`, :mod:`tests.test_tp3d_model`) share:
the model and training config, the cached training run and its checked one-process reference, the
pipeline-stage run (D, P, T) = (1, 2, 8) against one process, and the config-error helper.

A test module passes what differs: its ``facts(trainer)`` (what a rank's mesh says about the layout),
its run timeout, and ``sp=False`` where its configs name ``parallel.sequence_parallel`` (3D).
"""
import pytest
import torch.distributed as dist

from gridshard.testing import run_on_ranks
from gridshard.testing.compare import max_rel, max_rel_tensors
from gridshard.testing.train_cache import TrainCache

STEPS = 6           # steps of every run here; checkpoints (and validation passes) every SAVE_AT
SAVE_AT = 3
MODEL = {"preset": None, "vocab_size": 259, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2,
         "ffn_hidden": 64, "max_seq_len": 16}
BASE = {"model": MODEL,
        "data": {"kind": "stdlib", "seq_len": 16, "max_bytes": 50_000, "ignore_token": 32},
        "train": {"global_batch": 8, "micro_batch": 4, "steps": STEPS, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 2, "grad_clip": 0.5, "log_interval": 1, "seed": 7, "precision": "fp32",
                  "save_interval": SAVE_AT}}
TOL = 1e-5
# a Hugging Face Llama of the same shape (GQA, vocabulary 259); the tests add tie_word_embeddings
HF = {"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}


def config(T=1, mode="none", depth=1, zero=0, D=1, C=1, sp=None, **train):
    """The tests' config at (D, C, T) with ``tensor_mode`` and ``tensor_depth``, ZeRO stage ``zero`` and
    ``train`` overrides; ``sp``: ``parallel.sequence_parallel`` (None: left out of the config)."""
    parallel = {"data": D, "tensor": T, "tensor_mode": mode, "tensor_depth": depth, "context": C}
    if sp is not None:
        parallel["sequence_parallel"] = sp
    return {**BASE, "train": {**BASE["train"], "zero": zero, **train}, "parallel": parallel}


def train_body(cfg, facts, run_dir=None):
    """One rank's run of ``cfg``: (losses, grad norms, valid counts, final gathered parameters,
    ``facts(trainer)``); a compiled run resets dynamo first (a pooled worker: no graph cached by an
    earlier test)."""
    from gridshard import gathered_state_dict
    from gridshard.engine import Trainer

    if cfg["train"].get("compile"):
        import torch

        torch._dynamo.reset()
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    losses = trainer.run()
    final = gathered_state_dict(trainer.model)
    h = trainer.history
    return losses, [r["grad_norm"] for r in h], [r["valid_tokens"] for r in h], final, facts(trainer)


def _with_every_ranks_facts(per_rank):
    return (*per_rank[0][:4], [r[4] for r in per_rank])


def model_runs(facts, timeout) -> TrainCache:
    """``run(cfg, run_dir=None)`` → (losses, grad norms, valid counts, final parameters, every rank's
    ``facts``) of :func:`train_body`, run once per config (the ranks must agree on the history)."""
    return TrainCache(train_body, bind=(facts,), agree=3, combine=_with_every_ranks_facts, timeout=timeout)


def param_rel(got, ref):
    """The same parameter names, and the largest relative Frobenius error of ``got``'s against ``ref``'s
    (float64)."""
    assert sorted(got) == sorted(ref)
    return max_rel_tensors(got, ref)


def reference_fixtures(run, cfg):
    """The module-scoped fixtures ``reference_run`` (the one-process run of ``cfg`` through ``run``,
    checkpointing every SAVE_AT steps, and its run directory; some targets masked, clipping active)
    and ``reference`` (its result), for a test module to bind under those names."""

    @pytest.fixture(scope="module")
    def reference_run(tmp_path_factory):
        run_dir = tmp_path_factory.mktemp("one") / "run"
        ref = run(cfg, str(run_dir))
        assert min(ref[2]) < BASE["train"]["global_batch"] * BASE["data"]["seq_len"], "no target is masked"
        assert max(ref[1]) > BASE["train"]["grad_clip"], "clipping must be active"
        return run_dir, ref

    @pytest.fixture(scope="module")
    def reference(reference_run):
        return reference_run[1]

    return reference_run, reference


def pipeline_config(P=1, T=1, mode="none", depth=1, schedule="1f1b", V=1, layers=2, zero=0, sp=None):
    """Tied embeddings, a validation pass every SAVE_AT steps (through the stages at P > 1)."""
    cfg = config(T, mode, depth, zero=zero, sp=sp, eval_interval=SAVE_AT, eval_batches=1)
    cfg["model"] = {**MODEL, "layers": layers, "tie_embeddings": True}
    cfg["data"] = {**cfg["data"], "val_fraction": 0.1}
    cfg["parallel"] = {**cfg["parallel"], "pipeline": P, "pipeline_schedule": schedule, "virtual_stages": V}
    return cfg


def pipeline_body(cfg, facts=None):
    """(losses, grad norms, valid counts, validation losses, the whole model's final parameters
    merged over the stages, this rank's ``facts(trainer)`` (if given) with its pipeline group, stages
    and pipeline send bytes; None without stages)."""
    from gridshard import gathered_state_dict
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    parts = [None] * trainer.mesh.pipeline.size
    dist.all_gather_object(parts, gathered_state_dict(trainer.model), group=trainer.mesh.pipeline.group)
    final = {k: v for part in parts for k, v in part.items()}
    h = trainer.history
    mine = facts(trainer) if facts else {}
    stage_facts = {**mine, "pipe": trainer.mesh.pipeline.ranks, "stages": trainer.pipeline.stage_indices,
                   "sends": trainer.ledger.payload_bytes(op="send", axis="pipeline")} if trainer.pipeline else None
    return (losses, [r["grad_norm"] for r in h], [r["valid_tokens"] for r in h],
            [r.get("val_loss") for r in h], final, stage_facts)


def check_pipeline_run(mode, depth, schedule, V, layers, zero, what, sp=None, facts=None) -> list:
    """(D, P, T) = (1, 2, 8) at ``mode`` (q = 2, ``depth`` layers), ``V`` stages per rank over ``layers``
    layers, ZeRO ``zero``, tied embeddings, masked targets, against one process: the same valid counts,
    losses, gradient norms, validation losses and final parameters within TOL; the stage boundary's
    block is 1 KiB in fp32 and every rank's pipeline send bytes are the formula's over the 2·V stages.
    Returns every rank's :func:`pipeline_body` output (the last stage's rank last)."""
    from gridshard.theory.pipeline import boundary_bytes, step_send_bytes

    ref = run_on_ranks(1, pipeline_body, pipeline_config(layers=layers, sp=sp), facts, timeout=600)[0]
    got = run_on_ranks(16, pipeline_body, pipeline_config(2, 8, mode, depth, schedule, V, layers, zero, sp=sp), facts,
                       timeout=900)
    loss, norm, valid, val, params, _ = got[-1]           # the last stage's rank
    assert valid == ref[2] and min(valid) < 8 * 16 and max(ref[1]) > BASE["train"]["grad_clip"]
    assert [v is None for v in val] == [v is None for v in ref[3]] and val[SAVE_AT - 1] is not None
    dl, dn, dp = max_rel(loss, ref[0]), max_rel(norm, ref[1]), param_rel(params, ref[4])
    dv = max_rel([v for v in val if v is not None], [v for v in ref[3] if v is not None])
    print(f"{what}: loss {dl:.1e}, grad norm {dn:.1e}, val loss {dv:.1e}, final params {dp:.1e}")
    assert max(dl, dn, dp, dv) <= TOL, (dl, dn, dv, dp)
    per = boundary_bytes(mode, False, 8, BASE["train"]["micro_batch"], 16, MODEL["hidden"], depth=depth)
    assert per == 1 * 16 * 16 * 4                          # [m/(d·q), s, h/q] at 2.5D, [m/q², s, h/q] at 3D
    for r, out in enumerate(got):
        f = out[5]
        # the steps' forward and backward sends, and the validation passes' forward sends (A = 2 each)
        forward_only = STEPS // SAVE_AT * 2 * per * sum(s < 2 * V - 1 for s in f["stages"])
        assert f["sends"] == BASE["train"]["steps"] * step_send_bytes(f["stages"], 2 * V, 2, per) + forward_only, \
            (r, f["sends"])
    return got


def config_error(cfg, world):
    """The message of the ConfigError that resolving ``cfg`` on ``world`` ranks (no CUDA) must raise."""
    from gridshard.config import resolve_config
    from gridshard.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        resolve_config(cfg, world_size=world, cuda_available=False)
    return str(info.value)
