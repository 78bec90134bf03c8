"""Our MoE Llama and Hugging Face's ``MixtralForCausalLM`` (transformers 5: stacked experts
``gate_up_proj``/``down_proj``, router ``gate.weight``) are one model under one set of names:
Mixtral's weights load by the dense Llama's rename and give its logits; a trained MoE checkpoint
exports as a Mixtral that transformers loads with our logits; a shape Mixtral does not compute is
refused before anything is written."""
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
