"""The Mixture-of-Experts block on one device against a plain per-token loop written from the
formulas (gridshard/moe/routing.py, layer.py): routing, capacity drops in their documented order,
the sequence-wise aux loss and its gradient, shared experts, an expert with no token, the
balancing bias — forward and backward, fresh random inputs each test."""
import math

import pytest
import torch
import torch.nn.functional as F

from gridshard.moe.experts import grouped_linear
from gridshard.moe.layer import MoEBlock
from gridshard.moe.routing import capacity_mask
from gridshard.testing.compare import relative_error

H, N_EXP, K, FFN = 12, 4, 2, 20


def _block(score="softmax", normalize=True, capacity=None, shared=0, aux=0.0, seed=0):
    torch.manual_seed(seed)
    block = MoEBlock(H, N_EXP, K, FFN, shared_ffn=shared, score=score, normalize=normalize, capacity=capacity,
                     aux_coefficient=aux)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def _expert(x, gate_up, down):
    gate, up = gate_up.chunk(2, dim=0)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _reference(block, x, score, normalize, capacity):
    """(y, Σ_b L_b, kept [N, k], per-expert kept slots): token by token, from the module docstrings."""
    b, s, h = x.shape
    W, E = block.gate.weight, block.experts
    y, kept_all, aux = [], [], 0.0
    load = [0] * N_EXP
    limit = math.ceil(capacity * K * s / N_EXP) if capacity is not None else None
    for bi in range(b):
        used = [0] * N_EXP
        counts, prob = [0] * N_EXP, torch.zeros(N_EXP)
        for si in range(s):
            t = x[bi, si]
            z = W.float() @ t.float()
            p = z.softmax(-1) if score == "softmax" else z.sigmoid()
            chosen = torch.topk(p + block.gate.expert_bias, K).indices.tolist()
            g = p[chosen]
            if normalize:
                g = g / g.sum()
            out = torch.zeros(h)
            keep_row = []
            for j, e in enumerate(chosen):
                counts[e] += 1
                used[e] += 1
                keep = limit is None or used[e] <= limit
                keep_row.append(keep)
                if keep:
                    load[e] += 1
                    out = out + g[j] * _expert(t, E.gate_up_proj[e], E.down_proj[e])
            if block.shared_experts is not None:
                S = block.shared_experts
                out = out + _expert(t, S.gate_up_proj[0], S.down_proj[0])
            prob = prob + p / p.sum()
            y.append(out)
            kept_all.append(keep_row)
        f = torch.tensor(counts, dtype=torch.float32) * N_EXP / (K * s)
        aux = aux + (f * prob / s).sum()
    return torch.stack(y).view(b, s, h), aux, torch.tensor(kept_all), torch.tensor(load)


@pytest.mark.parametrize("score,normalize,capacity,shared", [
    ("softmax", True, None, 0), ("sigmoid", True, None, 8), ("softmax", False, 0.5, 0), ("sigmoid", False, 1.0, 8)])
def test_block_matches_the_per_token_loop_forward_and_backward(score, normalize, capacity, shared):
    block = _block(score, normalize, capacity, shared, aux=0.01)
    x = torch.randn(3, 8, H, requires_grad=True)
    r = torch.randn(3, 8, H)
    (block(x) * r).sum().backward()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}
    block.zero_grad()
    x.grad = None
    y_ref, aux_ref, kept, load = _reference(block, x, score, normalize, capacity)
    ((y_ref * r).sum() + 0.01 / 3 * aux_ref).backward()
    want = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    with torch.no_grad():
        assert relative_error(block(x), y_ref) < 1e-5
    for name in want:
        assert relative_error(got[name], want[name]) < 1e-5, name
    # the statistics: two calls (the gradient pass and the no-grad check above)
    assert torch.allclose(block.aux_sum, 2 * aux_ref.detach(), rtol=1e-5)
    assert torch.equal(block.load, 2 * load)
    assert int(block.dropped) == 2 * int((~kept).sum()) and int(block.slots) == 2 * 3 * 8 * K
    if capacity == 0.5:
        assert (~kept).any(), "the capacity test must drop something"


def test_capacity_keeps_the_first_slots_of_each_sequence_in_token_then_choice_order():
    # 2 sequences of 3 tokens, 2 experts, k = 2: every token picks both experts; capacity 1/3 → 1 slot each
    experts = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    kept = capacity_mask(experts, 2, 3, 1 / 3)
    assert kept.tolist() == [[True, True], [False, False], [False, False]] * 2


def test_the_aux_loss_is_a_sum_over_sequences_so_micro_batches_do_not_change_it():
    block = _block(aux=0.01)
    x = torch.randn(4, 6, H)
    with torch.no_grad():
        block(x)
        whole = block.aux_sum.clone()
        block.reset_stats()
        block(x[:1]), block(x[1:])
    assert torch.allclose(block.aux_sum, whole, rtol=1e-6) and float(whole) > 0


def test_an_expert_with_no_token_still_gets_a_zero_gradient():
    block = _block()
    block.gate.expert_bias[3] = -1e9                          # never selected
    block(torch.randn(2, 5, H)).sum().backward()
    assert int(block.load[3]) == 0
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(block.experts, name).grad
        assert grad is not None and torch.count_nonzero(grad[3]) == 0 and torch.count_nonzero(grad[:3]) > 0


def test_the_balancing_bias_moves_selection_not_weights():
    block = _block(normalize=False)
    x = torch.randn(2, 5, H)
    before = block.gate(x.view(-1, H), 5)
    block.gate.update_bias(torch.tensor([9, 1, 0, 0]), rate=10.0)
    assert block.gate.expert_bias.tolist() == [-10.0, 10.0, 10.0, 10.0]
    after = block.gate(x.view(-1, H), 5)
    assert not (after.experts == 0).any() and (before.experts == 0).any()
    scores = F.linear(x.view(-1, H), block.gate.weight).softmax(-1)
    assert torch.allclose(after.weights, scores.gather(-1, after.experts))      # unbiased scores


def test_grouped_linear_equals_one_product_per_expert_with_empty_blocks():
    x, w = torch.randn(7, 5), torch.randn(4, 3, 5)
    counts = [3, 0, 4, 0]
    want = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    assert torch.equal(grouped_linear(x, w, counts), want)


def _plain_experts(experts, x, counts):
    """Experts.forward with silu(g)·u written plainly (what it ran before it used ``swiglu``)."""
    gate, up = grouped_linear(x, experts.gate_up_proj, counts).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, experts.down_proj, counts)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
def test_experts_keep_g_and_u_not_silu_g_with_the_plain_expression_s_bits(dtype, autocast):
    """The experts' SwiGLU is nn.swiglu.swiglu (its fast path, an autograd Function): outputs and
    gradients equal ``F.silu(g) * u``'s bit for bit, and the saved tensors are the rows, the [M, 2f]
    gate|up output (g and u are its halves) and the product — silu(g), one more [M, f], is not kept."""
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.moe.experts import Experts

    torch.manual_seed(0)
    n, h, f, counts = 4, 12, 20, [5, 0, 7, 3]
    M = sum(counts)
    experts = Experts(n, h, f).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    rows = torch.randn(M, h, dtype=dtype)
    results = []
    for fn in (experts.forward, lambda x, c: _plain_experts(experts, x, c)):
        x = rows.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        with SavedTensorMeter(exclude=experts.parameters()) as meter, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(x, counts)
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        results.append((y, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad, meter))
    (y, *grads, meter), (y0, *grads0, meter0) = results
    assert torch.equal(y, y0)
    for g, g0 in zip(grads, grads0):
        assert torch.equal(g, g0)
    e = y.element_size()                                   # the activations' bytes (bf16 under autocast)
    copies = n * 3 * f * h * e if autocast else 0          # autocast's bf16 copies of the fp32 weights
    assert meter.bytes == M * (h + 3 * f) * e + copies
    assert meter0.bytes == meter.bytes + M * f * e         # the plain expression keeps silu(g) too
    assert sum(shape == (M, f) for shape, _, _ in meter.entries) == 1      # the product only
