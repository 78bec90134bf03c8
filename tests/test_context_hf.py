"""Context parallelism with a Hugging Face ``LlamaForCausalLM`` (``model.hf_config``): a run with the
sequence split over C context ranks is the one-process run, step by step.

The HF attention modules attend through gridshard's context attention (transformers' attention
interface, :data:`gridshard.models.hf.CONTEXT_ATTENTION`: no causal mask is built for the local
chunks), and the rotary embedding reads the chunks' global positions (``position_ids``;
pipelined: :meth:`gridshard.models.hf_stages.LlamaStagePieces.layer_inputs`).

Model: 8 query heads over 4 k/v heads (GQA), vocabulary 259 (not a multiple of T), tied and untied
embeddings; data: stdlib bytes with ``data.ignore_token: 32`` (about one target in six masked).
Each layout is compared with one process over 10 steps of AdamW, clipping active: loss and
global gradient norm within 1e-5 relative per step, final gathered parameters within 1e-5
(relative Frobenius). ``make test``: (D, P, C, T) = (1, 1, 4, 1) ring, untied. Wide: the same
tied and all_to_all, (1, 1, 2, 2) 1D + SP, (2, 1, 2, 1) ZeRO-2, (1, 2, 2, 1) 1F1B (pipelined HF
stages), (1, 1, 2, 4) 2D (q = 2), C = 2 with full recompute (all_to_all: the attention, collectives
included, runs again in backward; a Hugging Face model takes ``full``, not ``selective``), tied and
untied; and with 4 layers, V = 2, interleaved 1F1B at (1, 2, 2, 1), untied.
"""
import json

import pytest
import torch

from gridshard.testing.compare import max_rel, max_rel_tensors

from .test_context_training import run_config

pytest.importorskip("transformers")
TOL = 1e-5
HF = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 32}
BASE = {"data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000, "ignore_token": 32},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 10, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3,
                  "grad_clip": 0.5, "log_interval": 1, "seed": 7, "precision": "fp32"}}


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    """tied → the path of a config.json (written once per module)."""
    root = tmp_path_factory.mktemp("hf_context")
    paths = {}
    for tied in (False, True):
        paths[tied] = root / f"config-{'tied' if tied else 'untied'}.json"
        paths[tied].write_text(json.dumps({**HF, "tie_word_embeddings": tied}))
    return lambda tied: str(paths[tied])


def _config(path, D=1, C=1, T=1, P=1, mode="ring", sp=False, zero=0, tensor_mode=None, recompute="none"):
    return {**BASE, "model": {"hf_config": path}, "train": {**BASE["train"], "zero": zero, "recompute": recompute},
            "parallel": {"data": D, "pipeline": P, "context": C, "context_mode": mode, "tensor": T,
                         "tensor_mode": tensor_mode or ("1d" if T > 1 else "none"), "sequence_parallel": sp}}


def _run(path, **layout):
    return run_config(_config(path, **layout))


LAYOUTS = {  # name: _config's arguments
    "C4-ring": dict(C=4),
    "C4-all_to_all": dict(C=4, mode="all_to_all"),
    "C2-T2-1d-SP": dict(C=2, T=2, sp=True),
    "D2-C2-zero2": dict(D=2, C=2, zero=2),
    "P2-C2-1f1b": dict(P=2, C=2),
    "C2-T4-2d": dict(C=2, T=4, tensor_mode="2d"),
    "C2-full-all_to_all": dict(C=2, mode="all_to_all", recompute="full"),
}
FAST = set()          # every HF layout is in make test-all; make test has the attention and config tests
CASES = [(n, tied) for n in LAYOUTS for tied in (False, True)]


@pytest.mark.parametrize("name,tied", [pytest.param(n, t, marks=() if (n, t) in FAST else pytest.mark.wide,
                                                    id=f"{n}-{'tied' if t else 'untied'}") for n, t in CASES])
def test_hf_context_layout_gives_the_one_process_run(hf_json, name, tied):
    path = hf_json(tied)
    ref_loss, ref_norm, ref_valid, ref_params = _run(path)
    assert min(ref_valid) < BASE["train"]["global_batch"] * BASE["data"]["seq_len"], "no target is masked"
    assert max(ref_norm) > BASE["train"]["grad_clip"], "clipping must be active"
    loss, norm, valid, params = _run(path, **LAYOUTS[name])
    assert valid == ref_valid
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), max_rel_tensors(params, ref_params)
    print(f"HF {name} {'tied' if tied else 'untied'}: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert sorted(params) == sorted(ref_params)
    assert dl <= TOL, f"{name}: loss differs by {dl:.2e}"
    assert dn <= TOL, f"{name}: grad norm differs by {dn:.2e}"
    assert dp <= TOL, f"{name}: final parameters differ by {dp:.2e}"


@pytest.mark.wide
def test_hf_interleaved_1f1b_at_c2_gives_the_one_process_run(tmp_path):
    """(D, P, C, T) = (1, 2, 2, 1), 4 layers in V = 2 virtual stages per rank, interleaved 1F1B over
    Hugging Face stages, untied: within 1e-5 of one process per step and in the final parameters.
    lr 1e-3 and AdamW ε = 1e-6, as the 4-layer cases of tests/test_context_training.py (why: there)."""
    path = _write(tmp_path, False, num_hidden_layers=4)

    def cfg(**layout):
        c = _config(path, **layout)
        c["train"].update(lr=1e-3, min_lr=1e-4, adam_eps=1e-6)
        return c

    ref_loss, ref_norm, ref_valid, ref_params = run_config(cfg())
    assert max(ref_norm) > BASE["train"]["grad_clip"], "clipping must be active"
    piped = cfg(P=2, C=2)
    piped["parallel"].update(pipeline_schedule="interleaved_1f1b", virtual_stages=2)
    loss, norm, valid, params = run_config(piped)
    assert valid == ref_valid and sorted(params) == sorted(ref_params)
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), max_rel_tensors(params, ref_params)
    print(f"HF P2-C2-interleaved untied: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert max(dl, dn, dp) <= TOL, (dl, dn, dp)


def test_hf_attention_goes_through_the_context_attention_without_a_mask(tmp_path):
    """One process, the wiring only: after ``attend_over_context`` every self-attention calls the
    given ``attend`` with [b, H, s, d] queries, [b, H_kv, s, d] keys and values (GQA: not repeated),
    Hugging Face's scaling and no mask, also for positions that are not contiguous (a rank's two
    chunks, for which the SDPA mask path would build a packed-sequence mask); the positions are the
    chunks' global ones; a given mask, a sliding window or dropout is refused."""
    from transformers.masking_utils import create_causal_mask

    from gridshard.context import global_positions
    from gridshard.errors import LayoutError
    from gridshard.models.hf import _context_attention, attend_over_context, build_hf_causal_lm, position_ids

    model = build_hf_causal_lm(_write(tmp_path, False), device="cpu")
    calls = []

    def attend(q, k, v, scale):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), scale))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    layers = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    attend_over_context(model, layers, attend)
    positions = position_ids(8, (4, 1), "cpu")
    assert torch.equal(positions[0], global_positions(8, 4, 1)) and positions.tolist() == [[4, 5, 6, 7, 24, 25, 26, 27]]
    assert torch.equal(position_ids(6, (1, 0), "cpu")[0], torch.arange(6))
    x = torch.zeros(2, 8, HF["hidden_size"])
    assert create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                              position_ids=positions) is None
    model(input_ids=torch.randint(0, 259, (2, 8)), position_ids=positions, use_cache=False)
    assert calls == [((2, 8, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8), 8 ** -0.5)] * HF["num_hidden_layers"]
    q, kv = torch.zeros(1, 8, 4, 8), torch.zeros(1, 4, 4, 8)
    for bad in ({"attention_mask": torch.zeros(1, 1, 4, 4)}, {"sliding_window": 4}, {"dropout": 0.1}):
        with pytest.raises(LayoutError, match="Fix:"):
            _context_attention(layers[0], q, kv, kv, **{"attention_mask": None, **bad})


def _write(tmp_path, tied, **extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, "tie_word_embeddings": tied, **extra}))
    return str(path)


def test_hf_context_config_is_validated_before_launch(tmp_path):
    """A Hugging Face Llama at C > 1 resolves; a sliding-window family is refused (the context
    attention is plain causal), with the field, the window and a fix, by the config validator and
    by ``parallelize``'s wiring."""
    from gridshard.config import resolve_config
    from gridshard.errors import ConfigError

    cfg = resolve_config(_config(_write(tmp_path, True), C=2, T=2, sp=True, mode="all_to_all"), world_size=4,
                         cuda_available=False)
    assert cfg.parallel.context == 2 and cfg.model.hf_config is not None
    sliding = _write(tmp_path, False, model_type="mistral", sliding_window=16)
    with pytest.raises(ConfigError) as info:
        resolve_config(_config(sliding, C=2), world_size=2, cuda_available=False)
    msg = str(info.value)
    assert "model.hf_config=" in msg and "sliding window (16 tokens)" in msg and "parallel.context=1" in msg, msg
    from gridshard.errors import LayoutError
    from gridshard.models.hf import attend_over_context, build_hf_causal_lm

    mistral = build_hf_causal_lm(sliding)                  # on meta; the same refusal for gridshard.parallelize
    with pytest.raises(LayoutError, match="sliding_window=16.*Fix:"):
        attend_over_context(mistral, [], None)
    with pytest.raises(LayoutError, match="attention_dropout=0.1.*Fix:"):
        attend_over_context(build_hf_causal_lm(_write(tmp_path, False, attention_dropout=0.1)), [], None)
