"""Training a Mixture-of-Experts Llama (docs/moe.md; issue 38: data and expert parallelism and ZeRO
so far): the same per-step losses and MoE metrics at every data-parallel size, expert-parallel size,
dispatcher and ZeRO stage as one process, aux loss and capacity drops included (masked targets
present); a step in which an expert receives no token completes at every ZeRO stage; a run resumes
exactly, and at other expert-parallel sizes; the config rules."""
import pytest

from gridshard.config import load_config
from gridshard.config.validate import validate_config
from gridshard.errors import ConfigError
from gridshard.testing.compare import max_rel
from gridshard.testing.train_cache import TrainCache, train_on_ranks

MOE = {"preset": "tiny", "experts": 4, "experts_per_token": 2, "kv_heads": 2}
CFG = {"model": MOE, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000, "ignore_token": 32},
       "train": {"global_batch": 8, "micro_batch": 2, "steps": 8, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5,
                 "log_interval": 1, "seed": 7, "precision": "fp32", "moe_aux_loss": 0.05}}
METRICS = ("loss", "moe_aux_loss", "moe_load_max", "moe_dropped")


def _train(cfg, starve=None):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    if starve is not None:                       # no token is ever routed to expert `starve`
        for block in trainer.job.moe.blocks:
            block.gate.expert_bias[starve] = -1e9
    trainer.run()
    loads = [block.load.tolist() for block in trainer.job.moe.blocks]
    metrics = {key: [h[key] for h in trainer.history] for key in METRICS + ("moe_load",)}
    return metrics, loads


_RUNS = TrainCache(_train, agree=1, what="the losses and MoE metrics", timeout=300)


def _layout(data, zero=0, capacity=None, recompute="none", expert=1, dispatch="all_to_all", pipeline=1,
            schedule="1f1b", layers=None, context=1, context_mode="ring", tensor=1, mode="none", sp=False,
            micro_batch=2, depth=1, bias_rate=0.0):
    train = {**CFG["train"], "zero": zero, "moe_capacity": capacity, "recompute": recompute,
             "micro_batch": micro_batch, "moe_bias_rate": bias_rate}
    parallel = {"data": data, "expert": expert, "expert_dispatch": dispatch, "pipeline": pipeline,
                "pipeline_schedule": schedule, "virtual_stages": 2 if schedule in ("interleaved_1f1b", "zero_bubble")
                else 1, "context": context, "context_mode": context_mode, "tensor": tensor, "tensor_mode": mode,
                "sequence_parallel": sp, "tensor_depth": depth}
    model = {**MOE, "layers": layers, "moe_every": 2} if layers else MOE
    return {**CFG, "model": model, "parallel": parallel, "train": train}


def _assert_same(got, want):
    for key in METRICS:
        assert max_rel(got[key], want[key]) < 1e-5 if key != "moe_dropped" else got[key] == want[key], \
            (key, got[key], want[key])


@pytest.mark.parametrize("data,zero,capacity,recompute", [
    (4, 0, None, "none"), (2, 2, None, "none"), (2, 1, 1.0, "full"),
    pytest.param(2, 3, None, "none", marks=pytest.mark.wide), pytest.param(4, 2, 1.0, "none", marks=pytest.mark.wide),
    pytest.param(2, 0, None, "selective", marks=pytest.mark.wide)])
def test_data_parallel_and_zero_match_one_process(data, zero, capacity, recompute):
    one, _ = _RUNS(_layout(1, capacity=capacity))
    got, _ = _RUNS(_layout(data, zero, capacity, recompute))
    assert len(one["loss"]) == 8 and one["loss"][-1] < one["loss"][0]
    assert all(x > 0 for x in one["moe_aux_loss"]) and all(x >= 1 for x in one["moe_load_max"])
    assert (max(one["moe_dropped"]) > 0) == (capacity is not None)
    _assert_same(got, one)
    for shares, want in zip(got["moe_load"], one["moe_load"]):        # per expert, summing to 1
        assert len(shares) == 4 and abs(sum(shares) - 1) < 1e-9 and max_rel(shares, want) < 1e-5


@pytest.mark.parametrize("data,expert,zero,dispatch,capacity,recompute", [
    (4, 4, 0, "all_to_all", None, "none"), (2, 2, 2, "all_to_all", None, "none"),
    (4, 2, 1, "all_gather", 1.0, "full"),
    pytest.param(4, 2, 3, "all_to_all", None, "none", marks=pytest.mark.wide),
    pytest.param(4, 4, 3, "all_gather", None, "none", marks=pytest.mark.wide),
    pytest.param(4, 2, 2, "all_to_all", 1.0, "selective", marks=pytest.mark.wide)])
def test_expert_parallel_matches_one_process(data, expert, zero, dispatch, capacity, recompute):
    one, _ = _RUNS(_layout(1, capacity=capacity))
    got, _ = _RUNS(_layout(data, zero, capacity, recompute, expert, dispatch))
    _assert_same(got, one)
    for shares, want in zip(got["moe_load"], one["moe_load"]):
        assert max_rel(shares, want) < 1e-5


@pytest.mark.parametrize("data,expert,zero,schedule", [
    (2, 2, 0, "1f1b"), pytest.param(2, 2, 2, "gpipe", marks=pytest.mark.wide),
    pytest.param(2, 1, 1, "interleaved_1f1b", marks=pytest.mark.wide),
    pytest.param(2, 2, 2, "zero_bubble", marks=pytest.mark.wide)])
def test_pipeline_stages_with_experts_match_one_process(data, expert, zero, schedule):
    """P = 2 (4 layers, every other one MoE at 2 virtual stages: a stage may hold no MoE layer)."""
    layers = 4 if schedule in ("interleaved_1f1b", "zero_bubble") else None
    one, _ = _RUNS(_layout(1, layers=layers))
    got, _ = _RUNS(_layout(data, zero, expert=expert, pipeline=2, schedule=schedule, layers=layers))
    _assert_same(got, one)
    for shares, want in zip(got["moe_load"], one["moe_load"]):
        assert max_rel(shares, want) < 1e-5


@pytest.mark.parametrize("data,context,expert,mode,capacity", [
    (1, 2, 2, "ring", 1.0), pytest.param(2, 2, 4, "all_to_all", None, marks=pytest.mark.wide),
    pytest.param(2, 2, 2, "ring", 1.0, marks=pytest.mark.wide)])
def test_context_parallel_sequences_with_experts_match_one_process(data, context, expert, mode, capacity):
    """Each sequence on C ranks: its aux loss and its capacity drops are the whole sequence's."""
    one, _ = _RUNS(_layout(1, capacity=capacity))
    got, _ = _RUNS(_layout(data, 1, capacity, expert=expert, context=context, context_mode=mode))
    _assert_same(got, one)


@pytest.mark.parametrize("data,expert,tensor,mode,sp,zero", [
    (2, 2, 2, "1d", True, 1), pytest.param(2, 1, 2, "1d", False, 0, marks=pytest.mark.wide),
    pytest.param(2, 2, 4, "2d", False, 2, marks=pytest.mark.wide),
    pytest.param(2, 2, 8, "3d", False, 3, marks=pytest.mark.wide),
    pytest.param(1, 2, 8, "2.5d", False, 1, marks=pytest.mark.wide)])
def test_tensor_modes_with_experts_match_one_process(data, expert, tensor, mode, sp, zero):
    """The dense parts split by the tensor mode; each MoE block on the whole micro-batch. 2.5D: the
    expert ranks are the depth layers (E divides D·d there)."""
    one, _ = _RUNS(_layout(1))
    micro = 4 if mode in ("3d", "2.5d") else 2                         # 3D: q² batch blocks; 2.5D: d·q
    got, _ = _RUNS(_layout(data, zero, expert=expert, tensor=tensor, mode=mode, sp=sp, micro_batch=micro,
                          depth=2 if mode == "2.5d" else 1))
    _assert_same(got, one)


def test_the_balancing_bias_steers_alike_at_every_layout():
    """train.moe_bias_rate: the bias moves from the step's load summed over all ranks, the same everywhere."""
    plain, _ = _RUNS(_layout(1))
    one, _ = _RUNS(_layout(1, bias_rate=0.05))
    got, _ = _RUNS(_layout(4, 1, expert=2, bias_rate=0.05))
    _assert_same(got, one)
    assert max_rel(one["loss"], plain["loss"]) > 1e-4                # it steered the routing


def test_plot_draws_the_load_per_expert(tmp_path):
    import json
    import os

    from gridshard.plot import plot_run

    rec = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "peak_mem_bytes": 1}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(rec) + "\n")
    assert not any(p.endswith("moe_load.png") for p in plot_run(str(tmp_path)))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**rec, "step": 2, "moe_load": [0.4, 0.3, 0.2, 0.1]}) + "\n")
    assert os.path.isfile([p for p in plot_run(str(tmp_path)) if p.endswith("moe_load.png")][0])


@pytest.mark.parametrize("zero,expert", [(z, e) if (z, e) in ((3, 1), (2, 2)) else
                                         pytest.param(z, e, marks=pytest.mark.wide) for e in (1, 2) for z in range(4)])
def test_a_step_where_an_expert_gets_no_token_completes(zero, expert):
    """Expert 3 is never chosen: at E = 2 expert rank 1 holds it and computes it on no row."""
    cfg = {**_layout(2, zero, expert=expert), "train": {**_layout(2, zero)["train"], "steps": 2}}
    per_rank = train_on_ranks(_train, cfg, 3, timeout=300)
    metrics, loads = per_rank[0]
    assert all(layer[3] == 0 and sum(layer) > 0 for layer in loads), loads
    assert all(x == x for x in metrics["loss"])                   # finite, not NaN


def _rules(**sections):
    cfg = {"model": dict(MOE), **{k: v for k, v in CFG.items() if k != "model"}}
    for section, fields in sections.items():
        cfg[section] = {**cfg.get(section, {}), **fields}
    world = cfg.get("parallel", {}).get("data", 1)
    return validate_config(load_config(cfg), world_size=world, check_data=False)


@pytest.mark.parametrize("sections,words", [
    ({"model": {"experts_per_token": 5}}, "model.experts_per_token=5"),
    ({"model": {"experts": 0}}, "model.experts_per_token=2"),
    ({"model": {"experts": -1, "experts_per_token": None}}, "model.experts=-1"),
    ({"train": {"moe_capacity": 0}}, "train.moe_capacity=0"),
    ({"model": {"moe_every": 0}}, "model.moe_every=0"),
    ({"model": {"moe_every": 3}}, "model.moe_every=3"),
    ({"train": {"moe_bias_rate": -1e-3}}, "train.moe_bias_rate=-0.001"),
    ({"model": {"experts": 0, "experts_per_token": None}, "train": {"moe_capacity": 1.0}}, "train.moe_capacity=1.0"),
    ({"parallel": {"data": 4, "expert": 3}}, "parallel.expert=3 does not divide data × context = 4×1"),
    ({"model": {"experts": 6}, "parallel": {"data": 4, "expert": 4}},
     "parallel.expert=4 is invalid: every expert rank holds the same number of experts: parallel.expert must "
     "divide model.experts=6. Fix: use one of [1, 2]"),
    ({"model": {"experts": 0, "experts_per_token": None}, "parallel": {"data": 2, "expert": 2}},
     "parallel.expert=2 is invalid: it splits MoE experts but model.experts is 0"),
])
def test_bad_moe_fields_get_one_error_naming_the_value_and_a_fix(sections, words):
    with pytest.raises(ConfigError, match="Fix:") as err:
        _rules(**sections)
    assert words in str(err.value)


def test_the_parameter_count_and_flops_count_active_experts():
    from gridshard.theory.training import flops_per_token, model_flops_per_token

    mc = load_config({"model": {**MOE, "shared_experts": 1, "moe_every": 2, "layers": 4}}).model.resolve()
    h, fe, n, k, v = mc.hidden, mc.expert_ffn_hidden, 4, 2, mc.vocab_size
    attention = 2 * h * h + 2 * h * mc.kv_heads * mc.head_dim + 2 * h
    dense, moe, active = 3 * h * mc.ffn_hidden, (n + 1) * 3 * h * fe + h * n, (k + 1) * 3 * h * fe + h * n
    assert mc.num_parameters() == 2 * v * h + 4 * attention + 2 * dense + 2 * moe + h
    assert mc.num_parameters(active=True) == 2 * v * h + 4 * attention + 2 * dense + 2 * active + h
    dense_flops = flops_per_token(v, h, 4, mc.ffn_hidden, 32, mc.kv_heads * mc.head_dim)
    assert model_flops_per_token("llama", mc, 32) == dense_flops + 6 * 2 * (active - dense)
    from gridshard.models import Transformer
    import torch
    with torch.device("meta"):
        model = Transformer(mc)
    assert sum(p.numel() for p in model.parameters()) == mc.num_parameters()


def _resume_body(cfg, run_dir):
    from gridshard.engine import Trainer

    cont = Trainer({**cfg, "train": {**cfg["train"], "steps": 6}}, run_dir=f"{run_dir}/whole", progress=False).run()
    first = {**cfg, "train": {**cfg["train"], "steps": 3, "decay_steps": 6}}
    Trainer(first, run_dir=f"{run_dir}/split", progress=False).run()
    again = {**cfg, "train": {**cfg["train"], "steps": 6, "decay_steps": 6, "resume": "auto"}}
    return cont, Trainer(again, run_dir=f"{run_dir}/split", progress=False).run()


def test_a_run_resumes_exactly(tmp_path):
    """With capacity drops and the balancing bias, which the checkpoint carries."""
    cfg = {**CFG, "train": {**CFG["train"], "decay_steps": 6, "moe_capacity": 1.0, "moe_bias_rate": 0.05}}
    cont, resumed = train_on_ranks(_resume_body, cfg, str(tmp_path), timeout=300)[0]
    assert len(resumed) == 3 and resumed == cont[3:], (resumed, cont)
    from click.testing import CliRunner                            # the checkpoint generates in one process

    from gridshard.cli import main
    out = CliRunner().invoke(main, ["generate", str(tmp_path / "split"), "--prompt", "def ", "--max-new-tokens", "8"])
    assert out.exit_code == 0 and "step 6" in out.output, out.output


def _reshard_body(cfg, run_dir):
    from gridshard.engine import Trainer
    from gridshard.parallel import gathered_state_dict

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    losses = trainer.run()
    state = gathered_state_dict(trainer.model)
    return losses, state


def test_a_run_saved_at_one_expert_size_resumes_at_others(tmp_path):
    """Saved at E = 4 (D = 4, ZeRO-1), resumed at E = 1 (D = 4, ZeRO-0), E = 2 (D = 2, ZeRO-2) and
    (E = 2, T = 2 1D): the losses after the resume and the final weights are the uninterrupted E = 4 run's."""
    import os

    import torch

    from gridshard.checkpoint.files import checkpoints_root

    def cfg(data, expert, zero, tensor=1, **train):
        lay = _layout(data, zero, expert=expert, tensor=tensor, mode="1d" if tensor > 1 else "none")
        return {**lay, "train": {**lay["train"], "steps": 6, "decay_steps": 6, "save_interval": 3, **train}}

    full, state = train_on_ranks(_reshard_body, cfg(4, 4, 1), str(tmp_path / "e4"), timeout=300)[0]
    step3 = os.path.join(checkpoints_root(str(tmp_path / "e4")), "step_3")
    for data, expert, zero, tensor in ((4, 1, 0, 1), (2, 2, 2, 1), (2, 2, 1, 2)):
        losses, got = train_on_ranks(_reshard_body, cfg(data, expert, zero, tensor, resume=step3),
                                     str(tmp_path / f"e{expert}t{tensor}"), timeout=300)[0]
        assert len(losses) == 3 and max_rel(losses, full[3:]) < 1e-5, (expert, losses, full[3:])
        assert max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)) for k, v in state.items()) < 1e-4
        assert got.keys() == state.keys() and got["layers.0.mlp.experts.down_proj"].shape[0] == 4
        assert torch.is_tensor(got["layers.0.mlp.experts.gate_up_proj"])


@pytest.mark.wide
def test_compiled_layers_train_like_eager():
    one, _ = _RUNS(_layout(1))
    cfg = _layout(2, zero=1)
    got, _ = _RUNS({**cfg, "train": {**cfg["train"], "compile": True}})
    _assert_same(got, one)
