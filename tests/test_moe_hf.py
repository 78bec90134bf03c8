"""Our MoE Llama and Hugging Face's ``MixtralForCausalLM`` (transformers 5: stacked experts
``gate_up_proj``/``down_proj``, router ``gate.weight``) are one model under one set of names:
Mixtral's weights load by the dense Llama's rename and give its logits; a trained MoE checkpoint
exports as a Mixtral that transformers loads with our logits; a shape Mixtral does not compute is
refused before anything is written. A Mixtral, Qwen2-MoE or Qwen3-MoE ``model.hf_config`` is built with
our MoE block (transformers' logits and loss) and trains at every expert-parallel size as in one process."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gridshard.checkpoint.hf_io import export_hf, mixtral_shaped  # noqa: E402
from gridshard.errors import CheckpointError  # noqa: E402
from gridshard.models import ModelConfig, Transformer  # noqa: E402
from gridshard.models.hf import hf_to_gridshard_name  # noqa: E402
from gridshard.testing.compare import relative_error  # noqa: E402

DIMS = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=24, max_seq_len=64)


def test_mixtral_weights_load_by_rename_and_give_its_logits():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(config).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)                    # spread router scores: real top-2 choices
    theta = config.to_dict()["rope_parameters"]["rope_theta"]
    ours = Transformer(ModelConfig(**DIMS, norm_eps=config.rms_norm_eps, rope_theta=theta, experts=4,
                                   experts_per_token=2, expert_ffn_hidden=24)).eval()
    loaded = ours.load_state_dict({hf_to_gridshard_name(k): v for k, v in hf.state_dict().items()}, strict=False)
    assert not loaded.unexpected_keys                             # every Mixtral tensor has its place; ours has
    assert all(k.endswith("gate.expert_bias") for k in loaded.missing_keys)    # only the (zero) balancing bias more
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert relative_error(ours(tokens), hf(tokens).logits) < 1e-5


def _cfg():
    return {"model": {"preset": None, **DIMS, "vocab_size": 256, "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 24},
           "data": {"kind": "stdlib", "seq_len": 16, "max_bytes": 100_000},
           "train": {"global_batch": 2, "micro_batch": 2, "steps": 2, "warmup_steps": 1, "seed": 3,
                     "log_interval": 1}}


def _checkpoint(tmp_path, **model):
    from gridshard.engine import Trainer

    cfg = _cfg()
    Trainer({**cfg, "model": {**cfg["model"], **model}}, run_dir=str(tmp_path / "run"), progress=False).run()
    return str(tmp_path / "run" / "checkpoints" / "step_2")


def test_a_trained_moe_checkpoint_exports_as_a_mixtral_with_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from gridshard.checkpoint.reader import read_checkpoint
    from gridshard.models.vit import saved_model_config

    folder = _checkpoint(tmp_path)
    export_hf(folder, str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    checked, tensors = read_checkpoint(folder)
    ours = Transformer(saved_model_config(checked.meta["config"]["model"])).eval()
    ours.load_state_dict(tensors, strict=True)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert relative_error(hf(tokens).logits, ours(tokens)) < 1e-6
    from gridshard.engine import Trainer                       # and model.init_from reads the export back

    cfg = _cfg()
    again = Trainer({**cfg, "model": {**cfg["model"], "init_from": str(tmp_path / "hf")}}, progress=False)
    for name, value in again.job.model.state_dict().items():
        if name in tensors:
            assert torch.equal(value, tensors[name]), name
    assert {n for n, _ in again.job.model.named_parameters()} <= set(tensors)


def test_the_export_of_another_moe_shape_writes_nothing(tmp_path):
    folder = _checkpoint(tmp_path, shared_experts=1)
    with pytest.raises(CheckpointError, match="shared_experts=1"):
        export_hf(folder, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("field,value", [("moe_every", 2), ("router_score", "sigmoid"), ("router_normalize", False),
                                         ("shared_experts", 1)])
def test_a_shape_mixtral_does_not_compute_is_refused(field, value):
    shape = {"moe_every": 1, "router_score": "softmax", "router_normalize": True, "shared_experts": 0}
    mixtral_shaped(shape)
    with pytest.raises(CheckpointError, match=f"{field}={value!r}.*Fix:"):
        mixtral_shaped({**shape, field: value})


def test_a_balancing_bias_mixtral_has_no_place_for_is_dropped_when_zero_and_refused_otherwise():
    import torch

    from gridshard.checkpoint.hf_io import _without_zero_bias

    w = torch.ones(2)
    kept = _without_zero_bias({"layers.0.mlp.gate.weight": w, "layers.0.mlp.gate.expert_bias": torch.zeros(4)})
    assert list(kept) == ["layers.0.mlp.gate.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate\.expert_bias is not zero.*Fix:"):
        _without_zero_bias({"layers.0.mlp.gate.weight": w, "layers.0.mlp.gate.expert_bias": torch.tensor([0., .1])})


HF_MOE = {"mixtral": dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=24,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64),
          "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=32, intermediate_size=48,
                            moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=64),
          "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=256, hidden_size=32, intermediate_size=48,
                            moe_intermediate_size=24, shared_expert_intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=64)}


def _hf_config(tmp_path, kind):
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(HF_MOE[kind]))
    return str(path)


@pytest.mark.parametrize("kind", list(HF_MOE))
def test_an_hf_moe_config_builds_with_our_block_and_gives_transformers_logits_and_loss(tmp_path, kind):
    from transformers import AutoConfig, AutoModelForCausalLM

    from gridshard.models.hf import build_hf_causal_lm
    from gridshard.moe.layer import MoEBlock

    fields = dict(HF_MOE[kind])
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                              attn_implementation="sdpa").eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)                    # spread router scores: real top-2 choices
    ours = build_hf_causal_lm(_hf_config(tmp_path, kind), device="cpu").eval()
    assert sum(isinstance(m, MoEBlock) for m in ours.modules()) == 2
    loaded = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("gate.expert_bias") for k in loaded.missing_keys)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        got, want = ours(tokens, labels=tokens), theirs(tokens, labels=tokens)
    assert relative_error(got.logits, want.logits) < 1e-5 and abs(float(got.loss - want.loss)) < 1e-5


def _hf_train(cfg):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    trainer.run()
    return {key: [h[key] for h in trainer.history] for key in ("loss", "moe_aux_loss", "moe_load_max")}


@pytest.mark.parametrize("kind,data,expert,zero", [("qwen3_moe", 2, 2, 1),
                                                   pytest.param("mixtral", 4, 4, 3, marks=pytest.mark.wide),
                                                   pytest.param("qwen2_moe", 2, 2, 2, marks=pytest.mark.wide)])
def test_an_hf_moe_config_trains_at_every_expert_size_as_in_one_process(tmp_path, kind, data, expert, zero):
    from gridshard.testing.compare import max_rel
    from gridshard.testing.train_cache import train_on_ranks

    cfg = {"model": {"hf_config": _hf_config(tmp_path, kind)},
           "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
           "train": {"global_batch": 8, "micro_batch": 2, "steps": 4, "lr": 3e-3, "warmup_steps": 1, "seed": 5,
                     "log_interval": 1, "precision": "fp32", "moe_aux_loss": 0.05}}
    one = train_on_ranks(_hf_train, cfg, timeout=300)[0]
    got = train_on_ranks(_hf_train, {**cfg, "parallel": {"data": data, "expert": expert},
                                     "train": {**cfg["train"], "zero": zero}}, timeout=300)[0]
    assert one["loss"][-1] < one["loss"][0] and all(x > 0 for x in one["moe_aux_loss"])
    for key in one:
        assert max_rel(got[key], one[key]) < 1e-5, (key, got[key], one[key])


def _hf_run(cfg, run_dir):
    from gridshard.engine import Trainer

    Trainer(cfg, run_dir=run_dir, progress=False).run()


def test_an_hf_moe_run_exports_and_transformers_generates_our_greedy_text(tmp_path):
    """Qwen3-MoE trained from its config at E = 2: the export loads in transformers, which greedily
    generates what our model (its checkpoint's tensors) generates."""
    from transformers import AutoModelForCausalLM

    from gridshard.checkpoint.reader import read_checkpoint
    from gridshard.models.hf import build_hf_causal_lm
    from gridshard.testing.train_cache import train_on_ranks

    cfg = {"model": {"hf_config": _hf_config(tmp_path, "qwen3_moe")}, "parallel": {"data": 2, "expert": 2},
           "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
           "train": {"global_batch": 4, "micro_batch": 2, "steps": 3, "lr": 3e-3, "warmup_steps": 1, "seed": 5,
                     "log_interval": 1, "precision": "fp32", "moe_bias_rate": 0.0}}
    train_on_ranks(_hf_run, cfg, str(tmp_path / "run"), timeout=300)
    folder = str(tmp_path / "run" / "checkpoints" / "step_3")
    export_hf(folder, str(tmp_path / "hf"))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = build_hf_causal_lm(cfg["model"]["hf_config"], device="cpu").eval()
    ours.load_state_dict(read_checkpoint(folder)[1], strict=True)
    prompt = torch.tensor([list(b"def main(")])
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):                                   # our greedy decoding, one token at a time
            tokens = torch.cat([tokens, ours(tokens).logits[:, -1:].argmax(-1)], 1)
        want = theirs.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, want), (bytes(tokens[0].tolist()), bytes(want[0].tolist()))
