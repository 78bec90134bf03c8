"""The Llama's SwiGLU (:func:`gridshard.nn.swiglu.swiglu`, every ``train.recompute`` mode): it keeps
g and u for backward, not silu(g), which backward computes again from g (issue 43), and its
output and gradients are ``F.silu(g) * u``'s under autograd bit for bit (same ops), in fp32,
bf16 and under autocast; the compiled graph (``train.compile``) traces it."""
import pytest
import torch
import torch.nn.functional as F

from gridshard.engine.memory_meter import SavedTensorMeter
from gridshard.nn.swiglu import swiglu


def _grads(fn, gate, up, weight, autocast=False):
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fn(g, u)
        (y.float() * weight).sum().backward()
    return y.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-autocast"])
def test_swiglu_is_silu_times_up_bit_for_bit(dtype, autocast):
    gen = torch.Generator().manual_seed(3)
    gate = (4 * torch.randn(2, 8, 96, generator=gen)).to(dtype)     # both sides of silu's minimum
    up = torch.randn(2, 8, 96, generator=gen).to(dtype)
    weight = torch.randn(2, 8, 96, generator=gen)
    want = _grads(lambda g, u: F.silu(g) * u, gate, up, weight, autocast)
    got = _grads(swiglu, gate, up, weight, autocast)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    # a transposed (non-contiguous) operand, and only one operand needing a gradient
    gt, ut = gate.transpose(0, 1), up.transpose(0, 1)
    assert torch.equal(swiglu(gt, ut), F.silu(gt) * ut)
    u = up.clone().requires_grad_()
    (swiglu(gate, u).float() * weight).sum().backward()
    assert torch.equal(u.grad, want[2])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_swiglu_keeps_g_and_u_only(bf16):
    """Autograd keeps g and u (the plain expression: also silu(g), one more tensor of their size)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    gate, up = (torch.randn(4, 96, dtype=dtype, requires_grad=True) for _ in range(2))
    kept = {}
    for name, fn in (("plain", lambda g, u: F.silu(g) * u), ("swiglu", swiglu)):
        x, y = gate * 1, up * 1                     # non-leaf g and u, as the projections' outputs are
        with SavedTensorMeter(exclude=[gate, up]) as meter:
            fn(x, y)
        kept[name] = meter.bytes
    one = gate.numel() * gate.element_size()
    assert kept == {"plain": 3 * one, "swiglu": 2 * one}


def test_swiglu_compiles_like_eager():
    """Dynamo and AOT autograd trace the custom backward (one graph, no break); gradients as eager's."""
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(16, 32, generator=gen) for _ in range(2))
    loss = lambda g, u: swiglu(g, u).square().sum()                          # noqa: E731
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    compiled(g, u).backward()
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    loss(g2, u2).backward()
    assert torch.allclose(g.grad, g2.grad, rtol=1e-6, atol=1e-7)
    assert torch.allclose(u.grad, u2.grad, rtol=1e-6, atol=1e-7)
