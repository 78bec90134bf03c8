"""Rebuildable saved tensors (:mod:`gridshard.nn.rebuild`, part of ``train.recompute: selective``):
the tensor rebuilt in backward is the forward's bit for bit, the layer's gradients do not change,
and exactly the two norm outputs and silu(g)·u stop being kept (2·R·e + N·f·e per layer)."""
import copy

import pytest
import torch

from gridshard.engine.memory_meter import SavedTensorMeter
from gridshard.models import ModelConfig, Transformer
from gridshard.models.llama import SwiGLUMLP
from gridshard.nn.norm import rms_norm
from gridshard.nn.rebuild import RebuildRegion
from gridshard.parallel.recompute import apply_recompute

CFG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, ffn_hidden=96, max_seq_len=16)


def _packed(region, fn):
    """Run ``fn`` in an open region and return (its output, what the pack hook stores for it)."""
    region.open()
    try:
        out = fn()
        return out, region._match(out.transpose(0, 1))
    finally:
        region.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rebuilt_tensors_are_the_forwards_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 32, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(32, generator=g)).requires_grad_()           # not ones: w is in the recipe
    gate, up = (torch.randn(3, 8, 96, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mlp = SwiGLUMLP(CFG)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        region = RebuildRegion()
        y, packed = _packed(region, lambda: rms_norm(x, w, 1e-5, region))
        assert packed is not None
        assert torch.equal(packed.build(), y.transpose(0, 1))               # the consumer's view, rebuilt
        assert torch.equal(y, rms_norm(x, w, 1e-5))                         # the plain norm's values
        region.open()
        try:
            p = mlp.activation(gate, up)
            region.offer(p, mlp.activation, gate, up)
            packed = region._match(p.transpose(0, 1))
        finally:
            region.close()
    assert packed is not None and torch.equal(packed.build(), p.transpose(0, 1))


def test_an_unknown_or_freed_tensor_passes_through():
    region = RebuildRegion()
    region.open()
    try:
        a = torch.randn(4, 4)
        region.offer(a * 2, torch.mul, a, 2.0)      # offered, then freed at once: its address may be reused
        b = torch.randn(4, 4)
        assert region._match(b) is None and region._match(a) is None
    finally:
        region.close()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_selective_drops_the_rebuilt_tensors_and_keeps_the_gradients(bf16):
    torch.manual_seed(0)
    base = Transformer(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))

    def run(mode):
        model = copy.deepcopy(base)
        apply_recompute(model, mode)
        auto = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with SavedTensorMeter(exclude=model.parameters()) as meter, auto:
            model(tokens).float().square().mean().backward()
        return meter.bytes, [p.grad for p in model.parameters()]

    (kept, grads), (rebuilt, grads_r) = run("none"), run("selective")
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))          # bit for bit
    e, N = (2 if bf16 else 4), tokens.numel()
    lse = N * CFG.heads * 4
    per_layer = 2 * N * CFG.hidden * e + N * CFG.ffn_hidden * e + lse      # y twice, p, lse
    assert kept - rebuilt == CFG.layers * per_layer


@pytest.mark.wide
def test_compiled_layers_with_selective_pass_everything_through():
    """Under ``train.compile`` nothing is offered (the compiled graph keeps what it keeps) and the
    hooks hand every tensor on: the same loss and gradients as eager selective (fp32, 1e-6)."""
    from gridshard.parallel.compile import apply_compile

    torch.manual_seed(0)
    base = Transformer(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    out = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        apply_recompute(model, "selective")
        if compiled:
            apply_compile(model)
        loss = model(tokens).float().square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(out[0][1], out[1][1]))
