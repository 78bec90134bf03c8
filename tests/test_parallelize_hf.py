"""Hugging Face ``LlamaForCausalLM`` (built from a tiny config, no download; grouped-query
attention 4 heads / 2 kv heads, vocabulary 97 so padding is exercised, tied and untied)
laid out by ``gridshard.parallelize`` in 1D, 1D+SP (kv heads split at T=2, replicated at
T=4) and 2D q=2: the gathered state_dict equals Hugging Face's bit for bit (its real
weights are sliced, not redrawn), and loss, gathered logits and every gradient by Hugging
Face name agree within 1e-5 relative (fp32; observed ≤ ~1e-6, summation order only).
"""
import pytest
import torch

from gridshard.testing import run_on_ranks
from gridshard.testing.parallel_reference import compare_with_reference

transformers = pytest.importorskip("transformers")
TOL = 1e-5


def hf_tiny(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied, initializer_range=0.1)
    torch.manual_seed(5)                              # real weights, the same at every call
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _hf(T, mode, sp, tied):
    errors = compare_with_reference(lambda: hf_tiny(tied), 1, T, mode, sp, batch=4, seq=8, seed=1, hf=True)
    return {k: v for k, v in errors.items() if not k.startswith("grad:")}


CASES = {"T2-1d": (2, "1d", False, False), "T2-1d-SP-tied": (2, "1d", True, True),
         "T4-1d-kv-replicated": (4, "1d", False, True), "T4-1d-SP": (4, "1d", True, False),
         "T4-2d": (4, "2d", False, False), "T4-2d-tied": (4, "2d", False, True)}


@pytest.mark.parametrize("name", list(CASES))
def test_hf_llama_parallelized_equals_hf(name):
    T, mode, sp, tied = CASES[name]
    errors = run_on_ranks(T, _hf, T, mode, sp, tied)[0]
    for what in ("loss", "logits", "grad"):
        assert errors[what] <= TOL, f"{name}: {what} differs by {errors[what]:.2e}"


def _train_hf(path, D, T, mode, sp=False, zero=0):
    from gridshard.engine import Trainer

    cfg = {"model": {"hf_config": path}, "data": {"kind": "stdlib", "seq_len": 16, "max_bytes": 100_000},
           "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp},
           "train": {"global_batch": 4, "micro_batch": 2 if D < 4 else 1, "steps": 30, "lr": 3e-3,
                     "warmup_steps": 3, "grad_clip": 0.5, "log_interval": 1, "seed": 3, "zero": zero}}
    trainer = Trainer(cfg, progress=False)
    return trainer.run(), [h["grad_norm"] for h in trainer.history]


_HF_CONFIG_LAYOUTS = {            # (D, T, mode, sequence_parallel, zero)
    "D2-T2-1d-SP-zero3": (2, 2, "1d", True, 3), "D1-T4-2d": (1, 4, "2d", False, 0),
    "D4-none": (4, 1, "none", False, 0), "D1-T4-1d-kv-replicated": (1, 4, "1d", False, 0),
    "D2-T2-1d-SP": (2, 2, "1d", True, 0)}
_WIDE_HF_CONFIG_LAYOUTS = ("D4-none", "D1-T4-1d-kv-replicated", "D2-T2-1d-SP")   # make test-all


@pytest.mark.parametrize("layouts", [("D2-T2-1d-SP-zero3", "D1-T4-2d"),
                                     pytest.param(_WIDE_HF_CONFIG_LAYOUTS, marks=pytest.mark.wide)],
                         ids=["zero3-and-2d", "wide"])
def test_hf_config_trains_the_same_at_any_layout(tmp_path, layouts):
    """``model.hf_config`` builds the architecture on the meta device from a config.json;
    30 steps (clipping active) agree between one process and (D,T,mode) = (2,2,1d+SP) at ZeRO-3
    (the decoder layers ``model.layers.N`` are its gather units) and (1,4,2d) in ``make test``;
    (4,1,none), (1,4,1d) with kv heads replicated and (2,2,1d+SP) in ``make test-all``."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "max_position_embeddings": 32}))
    ref_loss, ref_norm = run_on_ranks(1, _train_hf, str(path), 1, 1, "none")[0]
    assert max(ref_norm) > 0.5, "clipping (grad_clip=0.5) must be active for the norm to matter"
    for D, T, mode, sp, zero in (_HF_CONFIG_LAYOUTS[name] for name in layouts):
        loss, norm = run_on_ranks(D * T, _train_hf, str(path), D, T, mode, sp, zero)[0]
        # fp32, 30 steps: summation order only (own model: ≤ 3e-6, docs/training.md)
        assert max(abs(a - b) / b for a, b in zip(loss, ref_loss)) <= 1e-4, (D, T, mode, sp, loss, ref_loss)
        assert max(abs(a - b) / b for a, b in zip(norm, ref_norm)) <= 1e-4, (D, T, mode, sp, norm, ref_norm)


def test_hf_weights_import_and_export_by_name(tmp_path):
    """A Hugging Face safetensors file loads into gridshard's own Transformer by renaming
    alone (same canonical shapes), the two models compute the same logits, and the export
    writes Hugging Face names back (round trip bit for bit)."""
    from safetensors.torch import load_file, save_file

    from gridshard.models import ModelConfig, Transformer
    from gridshard.models.hf import export_hf_state_dict
    from gridshard.testing.hf_weights import load_hf_weights
    from gridshard.testing.inputs import randint

    hf = hf_tiny(tied=False)
    hf.config.rms_norm_eps = 1e-5
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    ours = Transformer(ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=96,
                                   max_seq_len=32, norm_eps=1e-6))
    load_hf_weights(ours, load_file(str(path)))
    tokens = randint(97, (2, 8), 0)
    with torch.no_grad():
        ref = hf(input_ids=tokens, use_cache=False).logits
        got = ours(tokens)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5     # fp32, same math in another op order
    back = export_hf_state_dict(ours.state_dict())
    original = load_file(str(path))
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
