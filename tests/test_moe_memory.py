"""The memory model of a Mixture-of-Experts Llama (gridshard/theory/memory, docs/moe.md): the
parameter blocks read from the model laid out on the meta device are the real ranks' blocks (dense
and MoE layers, experts split over E expert ranks), and the model state a rank holds after real
optimizer steps equals ``model_state_bytes`` exactly at every ZeRO stage, the expert weights
sharded over the expert-data ranks."""
import pytest
import torch

from gridshard.engine.memory_meter import model_state_tensor_bytes
from gridshard.parallel.rank_blocks import rank_parameter_blocks
from gridshard.testing import run_on_ranks
from gridshard.testing.train_cache import train_on_ranks
from gridshard.theory.memory import model_state_bytes

MOE = {"preset": None, "vocab_size": 257, "hidden": 48, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_hidden": 120,
       "max_seq_len": 64, "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 40, "moe_every": 2,
       "shared_experts": 1}
CFG = {"model": MOE, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
       "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "lr": 3e-3, "warmup_steps": 1, "seed": 5,
                 "log_interval": 1, "precision": "fp32"}}


def _held(cfg):
    """(the laid-out blocks of this rank, measured and predicted model-state bytes) after the run."""
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    trainer.run()
    p, t = trainer.cfg.parallel, trainer.cfg.train
    got = model_state_tensor_bytes(trainer.model, trainer.optimizer, trainer.reducer.memory_tensors())
    blocks = rank_parameter_blocks(trainer.model_cfg, "none", 1, expert=p.expert)
    want = model_state_bytes(blocks, t.zero, p.data, trainer.mesh.data_context.rank, expert=p.expert)
    real = sorted((n, tuple(q.shape)) for n, q in trainer.model.named_parameters())
    return (real, sorted((b.name, b.shape) for b in blocks),
            {"optimizer": got["optimizer"], "held": got["params"] + got["grads"] + got["optimizer"] + got["extra"]},
            {"optimizer": want.optimizer, "held": want.held})


@pytest.mark.parametrize("zero,expert", [(0, 2), (1, 2), (3, 2), pytest.param(2, 2, marks=pytest.mark.wide),
                                         pytest.param(3, 1, marks=pytest.mark.wide)])
def test_moe_model_state_equals_the_formula_after_real_steps(zero, expert):
    cfg = {**CFG, "parallel": {"data": 2, "expert": expert}, "train": {**CFG["train"], "zero": zero}}
    for rank, (real, blocks, got, want) in enumerate(train_on_ranks(_held, cfg, timeout=300)):
        assert real == blocks, rank
        assert got == want, (rank, got, want)


def test_expert_blocks_are_marked_and_split():
    from gridshard.config import load_config

    mc = load_config({"model": MOE}).model.resolve()
    blocks = {b.name: b for b in rank_parameter_blocks(mc, "none", 1, expert=2)}
    assert blocks["layers.1.mlp.experts.gate_up_proj"].shape == (2, 80, 48)
    assert blocks["layers.1.mlp.experts.gate_up_proj"].expert and not blocks["layers.1.mlp.gate.weight"].expert
    assert "layers.0.mlp.gate_proj.weight" in blocks and "layers.2.mlp.experts.down_proj" not in blocks
    assert torch.Size(blocks["layers.3.mlp.shared_experts.down_proj"].shape) == (1, 48, 40)


def _saved(world, T, mode, sp, expert, recompute, precision, shared, every):
    """On each rank: the bytes one forward saves for backward (the meter) and the formula's."""
    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models import ModelConfig, Transformer
    from gridshard.parallel.recompute import apply_recompute
    from gridshard.theory.memory import activation_bytes

    cfg = ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=96, max_seq_len=16,
                      experts=4, experts_per_token=2, expert_ffn_hidden=40, shared_experts=shared, moe_every=every)
    with torch.device("meta"):
        plain = Transformer(cfg)
    mesh = build_mesh(world // T, 1, T, mode, expert=expert)
    model = parallelize(plain, mesh, sequence_parallel=sp, seed=0, device="cpu")
    if precision == "bf16":                                    # bf16 storage, as train.precision: bf16
        for p in model.parameters():
            p.data = p.data.bfloat16()
    apply_recompute(model, recompute)
    for block in model.modules():                              # the aux loss attached, as a training step does
        if hasattr(block, "aux_coefficient"):
            block.aux_coefficient = 0.01
    ctx = model.parallel_context
    g = torch.Generator().manual_seed(mesh.data.rank)          # each data rank its own tokens
    tokens, targets = torch.randint(0, 97, (4, 8), generator=g), torch.randint(0, 97, (4, 8), generator=g)
    with SavedTensorMeter(exclude=model.parameters()) as meter, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
    want = activation_bytes(cfg, 4, 8, mode, T, sp, recompute, precision=precision,
                            param_bytes=2 if precision == "bf16" else 4, expert=expert)
    return meter.bytes, want.total


@pytest.mark.parametrize("world,T,mode,sp,expert", [
    (1, 1, "none", False, 1), (2, 2, "1d", True, 1),
    pytest.param(2, 2, "1d", False, 1, marks=pytest.mark.wide), pytest.param(4, 4, "2d", False, 1, marks=pytest.mark.wide)])
def test_moe_saved_activations_equal_the_formula(world, T, mode, sp, expert):
    """Every recompute mode, fp32 and bf16 storage, with and without a shared expert, every layer MoE or
    every other one: the bytes saved for backward are the formula's, to the byte. (2D in fp32 only: its
    norms keep their gathered weight block in the parameters' dtype, which the dense formula prices at
    4 bytes, h/q·2 bytes too many per norm under bf16 storage: not an MoE term.)"""
    import itertools

    precisions = ("fp32",) if mode == "2d" else ("fp32", "bf16")
    for recompute, precision, shared, every in itertools.product(("none", "selective", "full"), precisions,
                                                                 (0, 1), (1, 2)):
        for rank, (got, want) in enumerate(run_on_ranks(world, _saved, world, T, mode, sp, expert, recompute,
                                                        precision, shared, every)):
            assert got == want, (rank, recompute, precision, shared, every, got, want)


@pytest.mark.parametrize("world,T,mode,sp", [(2, 1, "none", False), pytest.param(4, 2, "1d", True, marks=pytest.mark.wide)])
def test_at_two_expert_ranks_the_formula_is_their_mean(world, T, mode, sp):
    """E = 2: a rank's experts keep the rows routed to them, which depend on the routing; the formula
    prices M = N·k received rows, the mean over the expert ranks (every row sent is received once),
    to the byte, each rank within the routing's imbalance."""
    for recompute, precision in (("none", "fp32"), ("selective", "bf16")):
        res = run_on_ranks(world, _saved, world, T, mode, sp, 2, recompute, precision, 1, 1)
        want = res[0][1]
        assert sum(g for g, _ in res) == want * world, (recompute, precision, res)
        assert all(abs(g - want) < 0.1 * want for g, _ in res)


def _run_history(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.run()
    return trainer.history


@pytest.mark.wide
def test_the_trainer_predicts_an_moe_run_s_peak(tmp_path):
    """D = 2, E = 2, ZeRO-1: predicted_mem_bytes (baseline RSS + model state + activations) next to
    each fresh process's peak RSS, as for a dense run (tests/test_train_engine.py)."""
    from gridshard.testing import run_on_ranks

    cfg = {**CFG, "parallel": {"data": 2, "expert": 2}, "train": {**CFG["train"], "zero": 1, "steps": 3}}
    rec = run_on_ranks(2, _run_history, cfg, str(tmp_path), fresh=True)[0][-1]
    for peak, predicted in zip(rec["peak_mem_bytes_per_rank"], rec["predicted_mem_bytes_per_rank"]):
        assert 0.8 < predicted / peak < 1.25, (peak, predicted)
