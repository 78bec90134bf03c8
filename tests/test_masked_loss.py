"""Masked targets at every loss path: a micro-batch (or a 2D rank's batch block) with no
valid target contributes loss 0 and gradient 0 — never NaN — exactly as the plain
single-device model under ``F.cross_entropy``.

For each path (plain ``none``, 1D, 1D+SP, 2D, and a Hugging Face Llama on the 2D grid) the
laid-out model and the plain model (same seed, so the same global weights) see the same
tokens with targets

* ``all ignored``: every target is ``ignore_index``. ``F.cross_entropy`` gives loss NaN
  (mean) or 0 (sum) and all-zero gradients; the parallel loss must give the same value and
  gradients that are exactly zero (before the fix 1D and 2D gave NaN gradients). An AdamW
  step on those zero gradients leaves finite parameters equal to the plain model's.
* ``half ignored``: rows 0 … b/2−1 wholly ignored (in 2D q=2 that is all of batch block 0,
  so one grid row holds no valid target), row b/2 half ignored; loss (mean and sum) and
  every gathered gradient agree with the plain model within 1e-5 relative (fp32 summation
  order only, as in tests/test_parallelize.py).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer
from gridshard.parallel import context_of, gather_canonical, gathered_state_dict, parallelize
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error
from gridshard.testing.inputs import randint

IGNORE = -100
B, S = 4, 4
TOL = 1e-5


def _plain_model():
    with torch.device("meta"):
        return Transformer(ModelConfig(vocab_size=37, hidden=16, layers=1, heads=2, ffn_hidden=24, max_seq_len=S,
                                       tie_embeddings=True))


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=S)
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _targets(V):
    full = torch.full((B, S), IGNORE)
    half = randint(V, (B, S), 7)
    half[:B // 2] = IGNORE
    half[B // 2, :S // 2] = IGNORE
    return {"all ignored": full, "half ignored": half}


def _masked_losses(T, mode, sp, hf, seed):
    import torch.distributed as dist

    factory = _hf_model if hf else _plain_model
    ref = parallelize(factory(), build_mesh(dist.get_world_size(), 1, 1, "none"), seed=seed, device="cpu")
    mesh = build_mesh(1, 1, T, mode)
    par = parallelize(factory(), mesh, sequence_parallel=sp, seed=seed, device="cpu")
    ctx, ref_ctx = context_of(par), context_of(ref)
    V = ctx.vocab_size
    tokens = randint(V, (B, S), seed + 1)
    errors = {}
    for case, targets in _targets(V).items():
        for reduction in ("mean", "sum"):
            what = f"{case}, {reduction}"
            ref.zero_grad(set_to_none=True)
            par.zero_grad(set_to_none=True)
            ref_logits = ref_ctx.logits(ref, tokens)
            ref_loss = F.cross_entropy(ref_logits.reshape(-1, V).float(), targets.reshape(-1), ignore_index=IGNORE,
                                       reduction=reduction)
            ref_loss.backward()
            loss = ctx.model_loss(par, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), IGNORE, reduction)
            loss.backward()
            if math.isnan(float(ref_loss)):
                assert math.isnan(float(loss)), f"{what}: loss {float(loss)} where F.cross_entropy gives NaN"
                errors[f"{what}: loss"] = 0.0
            else:
                errors[f"{what}: loss"] = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
            worst = 0.0
            for name, p in par.named_parameters(remove_duplicate=False):
                g = gather_canonical(p.grad, ctx.layouts[name], mesh)
                ref_g = ref.get_parameter(name).grad
                assert torch.isfinite(g).all(), f"{what}: {name} has a non-finite gradient"
                if case == "all ignored":
                    assert not ref_g.any(), f"{what}: the plain model's {name} gradient is not zero"
                    assert not g.any(), f"{what}: {name} gradient is not zero (max {float(g.abs().max()):.2e})"
                else:
                    worst = max(worst, relative_error(g, ref_g))
            errors[f"{what}: grad"] = worst
        if case == "all ignored":      # the last backward was the all-ignored sum: zero gradients
            for model in (ref, par):
                torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1).step()
            got, want = gathered_state_dict(par), ref.state_dict()
            assert all(torch.isfinite(v).all() for v in got.values()), "non-finite parameters after the step"
            errors["step: params"] = max(relative_error(got[k], v) for k, v in want.items())
    return errors


CASES = {"none": (1, "none", False, False), "T2-1d": (2, "1d", False, False), "T2-1d-SP": (2, "1d", True, False),
         "T4-2d": (4, "2d", False, False), "hf-T4-2d": (4, "2d", False, True)}


@pytest.mark.parametrize("name", list(CASES))
def test_masked_targets_give_the_plain_models_loss_and_gradients(name):
    T, mode, sp, hf = CASES[name]
    if hf:
        pytest.importorskip("transformers")
    per_rank = run_on_ranks(T, _masked_losses, T, mode, sp, hf, 3, timeout=120)
    errors = per_rank[0]
    assert all(e == errors for e in per_rank), "tensor ranks disagree"
    for what, err in errors.items():
        assert err <= TOL, f"{name}, {what}: relative error {err:.2e}"
