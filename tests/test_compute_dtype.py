"""Activations in the compute dtype (issue 23): under bf16/fp16 autocast gridshard's model keeps
its residual stream, norms' outputs and RoPE tables in the compute dtype, norms compute in fp32
inside, and the loss is fp32; without autocast nothing changes.

* :func:`gridshard.nn.norm.rms_norm` on a bf16/fp16 input against an fp32 reference
  (``F.rms_norm`` on the upcast input), forward and backward, on fresh random data at two
  sizes; on an fp32 input it *is* ``F.rms_norm`` (bit for bit);
* the model under CPU bf16 autocast: every decoder layer's output, every norm's output and
  the logits are bf16, the RoPE tables come from the cache in bf16, the loss is fp32;
* a short bf16 training run of the tiny model follows the fp32 loss curve (100 steps at
  (4,1,none) and (2,2,1d+SP): ``benchmarks/bench_bf16_curve.py``, ``tests/test_bf16_curve.py``,
  docs/memory.md "bf16 against fp32").
"""
import pytest
import torch
import torch.nn.functional as F

from gridshard.nn.norm import rms_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 7, 48)])
def test_low_precision_rms_norm_matches_an_fp32_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    h = shape[-1]
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(h, generator=g)).requires_grad_()
    grad_y = torch.randn(shape, generator=g).to(dtype)
    ref_x, ref_w = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    y = rms_norm(x, w, 1e-5)
    ref = F.rms_norm(ref_x, (h,), ref_w, 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref.to(dtype))                     # fp32 arithmetic, one rounding
    y.backward(grad_y)
    ref.backward(grad_y.float())
    assert x.grad.dtype == dtype and w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, ref_x.grad.to(dtype))
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)


def test_fp32_rms_norm_is_f_rms_norm_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 6, 32, generator=g), torch.randn(32, generator=g)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6))


def _tiny_model():
    from gridshard.models import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64,
                                   max_seq_len=16))


def test_activations_are_in_the_compute_dtype_under_autocast():
    model = _tiny_model()
    seen = {}
    for name, module in model.named_modules():
        if name.endswith(("norm", "layernorm")) or name.startswith("layers.") and name.count(".") == 1 \
                or name == "lm_head":
            module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, 61).float(), tokens.reshape(-1))
    assert len(seen) == 2 * 3 + 2 and set(seen.values()) == {torch.bfloat16}, seen
    assert loss.dtype == torch.float32
    cached = {key[-1] for key in model.rope_cache.tables}
    assert cached == {torch.bfloat16}
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())    # parameters keep their dtype
    seen.clear()
    model(tokens)                                                               # no autocast: fp32 throughout
    assert set(seen.values()) == {torch.float32}


def _losses(precision, pipeline=1, steps=8):
    import torch.distributed as dist

    from gridshard.engine import Trainer

    cfg = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
           "parallel": {"pipeline": pipeline},
           "train": {"global_batch": 4, "micro_batch": 2, "steps": steps, "lr": 3e-3, "warmup_steps": 2,
                     "log_interval": 1, "seed": 5, "precision": precision}}
    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    per_layer = trainer._predict_memory(None, None).details["per_layer"]       # what predicted_mem_bytes uses
    return (losses, per_layer) if dist.get_rank() == dist.get_world_size() - 1 else None


def test_bf16_training_follows_the_fp32_loss_curve():
    from gridshard.testing import run_on_ranks

    from gridshard.config import load_config
    from gridshard.theory.memory import layer_saved_bytes

    (fp32, fp32_layer), (bf16, bf16_layer) = (run_on_ranks(1, _losses, p, timeout=300)[0] for p in ("fp32", "bf16"))
    mc = load_config(None, ["model.preset=tiny"]).model.resolve()
    # the trainer's prediction prices the activations in the run's compute dtype
    assert (fp32_layer, bf16_layer) == tuple(layer_saved_bytes(mc, "none", 1, False, 2 * 32, "none", e) for e in (4, 2))
    assert fp32[-1] < 0.8 * fp32[0]                          # it learns
    rel = [abs(a - b) / a for a, b in zip(fp32, bf16)]
    assert max(rel) < 0.02, rel
    assert fp32 != bf16                                      # bf16 really ran in bf16


@pytest.mark.wide
def test_bf16_pipeline_stages_send_bf16_and_match_one_process():
    """Over 2 pipeline stages, which send the bf16 hidden states (``Transformer.hidden_dtype``:
    the stage's declared activation dtype), the same computation as one process: the same losses."""
    from gridshard.testing import run_on_ranks

    single = run_on_ranks(1, _losses, "bf16", timeout=300)[0][0]
    staged = run_on_ranks(2, _losses, "bf16", 2, timeout=300)[-1][0]
    assert staged == pytest.approx(single, rel=1e-5)
