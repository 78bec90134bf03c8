"""Engine pieces: DP gradient traffic = theory, schedule, loss-scaling agreement, bf16,
tied embeddings at every mode, metrics and run files."""
import json
import math
import os

import pytest
import torch

from gridshard.comm.ledger import LEDGER
from gridshard.engine import Trainer, train
from gridshard.engine.clip import counts_here
from gridshard.engine.optim import build_optimizer
from gridshard.engine.precision import Precision
from gridshard.schedule import lr_at
from gridshard.models import ModelConfig, Transformer
from gridshard.testing import run_on_ranks
from gridshard.theory.training import bucket_partition, dp_gradient_allreduce, flops_per_token, matmul_params

SMALL = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
         "train": {"global_batch": 4, "micro_batch": 1, "steps": 3, "log_interval": 1, "lr": 1e-3}}


def _with(par, **train_fields):
    return {**SMALL, "parallel": par, "train": {**SMALL["train"], **train_fields}}


def _ledger_body(cfg):
    LEDGER.reset()
    trainer = Trainer(cfg, progress=False)
    trainer.run()
    # the job records into its own ledger, never into the process default
    assert LEDGER.count() == 0, LEDGER.summary()
    steps = cfg["train"]["steps"]
    # buckets counted here, not by the code under test: consecutive fp32 gradients, a new
    # bucket whenever the next one would exceed bucket_mb (a lone larger one gets its own)
    cap, buckets, filled = int(cfg["train"]["bucket_mb"] * 2**20), 0, None
    for p in trainer.params:
        b = p.numel() * 4
        if filled is None or filled + b > cap:
            buckets, filled = buckets + 1, 0
        filled += b
    led = trainer.ledger
    return (led.count("all_reduce", "data"), led.payload_bytes("all_reduce", "data"),
            steps * buckets, len(trainer.reducer.units), sum(p.numel() for p in trainer.params))


@pytest.mark.parametrize("par", [{"data": 2}, {"data": 2, "tensor": 2, "tensor_mode": "1d"}],
                         ids=["D2", "D2-T2-1d"])
def test_data_parallel_traffic_equals_theory(par):
    world = par["data"] * par.get("tensor", 1)
    cfg = _with(par, bucket_mb=0.02)                  # ~20 KB buckets: several per step
    for count, payload, want_count, buckets, numel in run_on_ranks(world, _ledger_body, cfg):
        assert buckets > 2 and count == want_count == 3 * buckets   # one all-reduce per bucket per step
        assert payload == 3 * numel * 4               # every local gradient once per step, any accumulation
        want = dp_gradient_allreduce([numel], 2, 4)   # the formula agrees on the bytes
        assert payload == 3 * want.payload_bytes("all_reduce")


def _overlap_body(cfg):
    """One step by hand: after the armed backward, before sync, every bucket's all-reduce
    must already be in flight; the synced gradients equal the non-overlapped ones."""
    grads = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        trainer = Trainer({**cfg, "train": {**cfg["train"], "overlap_grad_reduce": overlap}}, progress=False)
        sync = trainer.reducer
        (tokens, targets), = trainer.plan.micro_batches(0)
        sync.arm()
        ctx = trainer.context
        ctx.model_loss(trainer.model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets)).backward()
        issued_in_backward = sum(u.reductions for u in sync.units)
        sync.sync()
        grads[overlap] = [p.grad.clone() for p in trainer.params]
        if overlap:
            assert issued_in_backward == len(sync.units) > 2, (issued_in_backward, len(sync.units))
        else:
            assert issued_in_backward == 0
    return all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("par", [{"data": 2}, {"data": 2, "tensor": 2, "tensor_mode": "1d"}],
                         ids=["D2", "D2-T2-1d"])
def test_gradient_buckets_are_reduced_during_backward(par):
    cfg = _with(par, bucket_mb=0.02, global_batch=2)   # one micro-batch per data rank
    assert all(run_on_ranks(par["data"] * par.get("tensor", 1), _overlap_body, cfg))


def test_bucket_partition_and_flops_formula():
    assert bucket_partition([10, 10, 10, 50, 5], 4, 80) == [[0, 1], [2], [3], [4]]
    assert matmul_params(256, 64, 2, 176) == 2 * (4 * 64 * 64 + 3 * 64 * 176) + 256 * 64
    for cfg in (ModelConfig(), ModelConfig(kv_heads=2)):                     # multi-head and grouped-query
        with torch.device("meta"):
            linear = sum(m.weight.numel() for m in Transformer(cfg).modules() if isinstance(m, torch.nn.Linear))
        kv_hidden = cfg.kv_heads * cfg.head_dim
        assert matmul_params(cfg.vocab_size, cfg.hidden, cfg.layers, cfg.ffn_hidden, kv_hidden) == linear
        assert flops_per_token(256, 64, 2, 176, 32, kv_hidden) == 6 * linear + 12 * 2 * 32 * 64
        with torch.device("meta"):
            assert cfg.num_parameters() == sum(p.numel() for p in Transformer(cfg).parameters())


def test_schedule_warmup_cosine_constant():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [lr_at(k, **kw) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)
    assert lr_at(50, schedule="constant", **kw) == 1.0


def test_weight_decay_only_on_matrices():
    model = Transformer(ModelConfig())
    decay, no_decay = build_optimizer(model, 1e-3, 0.1).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * 2 + 1


def test_norm_ownership_counts_each_parameter_once():
    from gridshard.mesh import ShapeMesh
    from gridshard.nn.sharding import ShardSpec, set_spec

    def _Mesh2D(i, j):                  # grid position (i, j) of a q = 2 grid, no process group
        return ShapeMesh(tensor=4, tensor_mode="2d", tensor_rank=2 * i + j)

    specs = {"replicated": None, "col-split": ShardSpec((8,), ((0, "grid_col"),)),
             "both": ShardSpec((8, 8), ((0, "grid_row"), (1, "grid_col"))),
             "flat": ShardSpec((8,), ((0, "tensor"),))}
    for name, spec in specs.items():
        p = torch.nn.Parameter(torch.zeros(2))
        if spec is not None:
            set_spec(p, spec)
        owners = [(i, j) for i in range(2) for j in range(2) if counts_here(p, _Mesh2D(i, j))]
        blocks = {None: 1, "col-split": 2, "both": 4, "flat": 4}[name if spec else None]
        assert len(owners) == blocks, (name, owners)


def test_fp16_overflow_decision_is_the_global_one():
    """One rank's shard overflowing must make every rank skip: the verdict comes from the
    global norm, not from the local gradients (which are finite here)."""
    for global_norm, should_step in ((torch.tensor(float("inf")), False), (torch.tensor(3.0), True)):
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([p], lr=0.1)
        prec = Precision("fp16", torch.device("cpu"))
        scale0 = prec.loss_scale()
        prec.scale((p * 2).sum()).backward()
        prec.unscale(opt)
        assert torch.allclose(p.grad, torch.full((4,), 2.0))
        prec.agree_on_overflow(opt, global_norm)
        prec.step(opt)
        assert (not torch.equal(p.detach(), torch.ones(4))) == should_step
        assert (prec.loss_scale() < scale0) == (not should_step)


def _bf16_body(cfg):
    return train(cfg)


def test_bf16_autocast_trains_close_to_fp32():
    cfg = _with({"data": 1}, steps=8, precision="bf16", lr=3e-3)
    bf16 = run_on_ranks(1, _bf16_body, cfg)[0]
    fp32 = run_on_ranks(1, _bf16_body, _with({"data": 1}, steps=8, precision="fp32", lr=3e-3))[0]
    assert bf16 != fp32, "bf16 autocast changed nothing"
    # bf16 rounds activations to 8 mantissa bits (~4e-3 relative) and the trajectories drift
    # apart over 8 steps; 3% bounds that drift while a broken autocast path (e.g. no
    # gradient flowing back through a cast) would stop the loss from falling at all
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 0.03
    assert bf16[-1] < bf16[0]


def _losses_and_norms(cfg):
    trainer = Trainer(cfg, progress=False)
    return trainer.run(), [h["grad_norm"] for h in trainer.history]


def test_bf16_2d_matches_one_device_bf16():
    """bf16 autocast through SUMMA (bf16 activations meet fp32 weights in Linear2D): losses
    AND gradient norms (a gradient-scale bug leaves the loss of the first steps almost
    unchanged). bf16 has 8 mantissa bits (~4e-3 relative rounding); the grid's different
    summation order measured 1.8e-5 on the loss and 3.3e-4 on the norm over these 4 steps,
    so 1e-3 / 5e-3 keep a >10x margin while a factor-2 gradient bug exceeds them."""
    cfg = _with({"tensor": 4, "tensor_mode": "2d"}, steps=4, micro_batch=2, precision="bf16", lr=3e-3)
    grid_loss, grid_norm = run_on_ranks(4, _losses_and_norms, cfg)[0]
    ref_loss, ref_norm = run_on_ranks(1, _losses_and_norms, {**cfg, "parallel": {"data": 1}})[0]
    assert max(abs(a - b) / b for a, b in zip(grid_loss, ref_loss)) < 1e-3
    assert max(abs(a - b) / b for a, b in zip(grid_norm, ref_norm)) < 5e-3


# tied embeddings at D>1 with SP and in 2D: tests/test_train_equivalence.py (loss, grad norm
# and final parameters), and laid-out against one device in tests/test_parallelize*.py


def _metrics_body(cfg, run_dir):
    from gridshard.engine.metrics import peak_memory_bytes

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    before = peak_memory_bytes(trainer.device)          # this rank's peak so far (only grows)
    losses = trainer.run()
    return losses, trainer.history, (before, peak_memory_bytes(trainer.device))


METRIC_KEYS = {"step", "loss", "valid_tokens", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_share", "peak_mem_bytes",
               "peak_mem_bytes_per_rank", "step_time_s", "tokens", "elapsed_s", "loss_scale", "bubble_share",
               "bubble_share_per_rank", "predicted_mem_bytes", "predicted_mem_bytes_per_rank", "skipped_steps",
               "peak_mem_reserved_bytes", "rank_wait_max", "straggler_rank"}


def test_metrics_and_run_files(tmp_path):
    cfg = _with({"data": 2}, steps=5, log_interval=2)
    out = run_on_ranks(2, _metrics_body, cfg, str(tmp_path), fresh=True)   # the peak RSS is the process's
    losses, history, _ = out[0]
    assert [h["step"] for h in history] == [2, 4, 5]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(set(rec) == METRIC_KEYS for rec in lines)
    for rec, step in zip(lines, (2, 4, 5)):
        assert rec["loss"] == pytest.approx(losses[step - 1])
        assert 0.0 < rec["comm_share"] < 1.0 and rec["mfu"] is None        # CPU: no peak known
        assert rec["peak_mem_reserved_bytes"] is None                     # CPU: no allocator reserve
        # the memory model's prediction (baseline RSS + model state + activations) next to the peak RSS
        for peak, predicted in zip(rec["peak_mem_bytes_per_rank"], rec["predicted_mem_bytes_per_rank"]):
            assert 0.8 < predicted / peak < 1.25, (peak, predicted)
        per_rank = rec["peak_mem_bytes_per_rank"]
        assert len(per_rank) == 2 and rec["peak_mem_bytes"] == max(per_rank)
        # each entry is that rank's own peak RSS: between its value before training and after
        for r, (before, after) in enumerate(o[2] for o in out):
            assert before <= per_rank[r] <= after, (r, before, per_rank[r], after)
        assert rec["tokens"] == step * 4 * 32 and rec["tokens_per_s"] > 0
        assert rec["valid_tokens"] == 4 * 32          # no data.ignore_token: every target of the step
    saved = (tmp_path / "config.yaml").read_text()
    assert "tensor_mode: none" in saved and "hidden: 64" in saved
    same = ("step", "loss", "lr", "grad_norm", "comm_share", "peak_mem_bytes_per_rank", "tokens")
    assert [{k: h[k] for k in same} for h in out[1][1]] == [{k: h[k] for k in same} for h in history]
    # rank 0 writes the run files; the end-of-run checkpoint (save_interval 0) is the only other entry
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.yaml", "launch.json", "metrics.jsonl", "ranks.jsonl"]
    ranks = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ranks] == [2, 4, 5] and all(len(r["ranks"]) == 2 for r in ranks)
    for r, rec in zip(ranks, lines):             # the per-rank table behind the record's two fields
        assert r["rank_wait_max"] == rec["rank_wait_max"] == max(x["wait_s"] for x in r["ranks"]) >= 0
        assert min(x["wait_s"] for x in r["ranks"]) == 0 and r["straggler_rank"] == rec["straggler_rank"]
        assert all(x["compute_s"] + x["comm_s"] + x["data_s"] == pytest.approx(r["step_time_s"]) for x in r["ranks"])
    assert math.isfinite(losses[-1])
