"""The 2D and 3D LayerNorms (the Vision Transformer's) on bf16 activations and parameters compute
their statistics in fp32, as torch's own ``nn.LayerNorm`` does for bf16 tensors (and autocast for
``layer_norm``): against an fp32 ``F.layer_norm`` of the same bf16 numbers, the output, the input
gradient and the weight and bias gradients are as close as torch's bf16 ``nn.LayerNorm``'s own
(at most 2× its error, which is the output's bf16 rounding), on inputs of mean 100 where a bf16
Σx over h/q values is off by units. The statistics' all-reduces travel in fp32 and the vectors in
bf16: the ledger equals ``layernorm2d_comm`` / ``layernorm3d_comm`` at e = 2 exactly.

make test: 2D q = 2 (4 ranks). Wide: 3D q = 2 (8 ranks), both orientations of the cube.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gridshard.comm import LEDGER
from gridshard.nn.sharding import get_spec, take_shard
from gridshard.tensor.tp2d import theory as tp2d
from gridshard.tensor.tp2d.norm import LayerNorm2D
from gridshard.tensor.tp3d import theory as tp3d
from gridshard.tensor.tp3d.mesh import build_mesh_3d
from gridshard.tensor.tp3d.norm import LayerNorm3D
from gridshard.testing import run_on_ranks

from .test_tp2d_helpers import block, expected_shard, fresh_seed, ledger_matches, mesh_2d, randn

B, S, H = 4, 3, 16
BF16 = torch.bfloat16


def _rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _case(mode, q, swapped, seed):
    """(what, the LayerNorm, my block of a global activation, my shard of a global [h] vector with a
    spec, the ledger's expected volume)."""
    if mode == "2d":
        mesh = mesh_2d(q)
        return (f"LayerNorm2D q={q}", LayerNorm2D(H, mesh, eps=1e-5, dtype=BF16), lambda t: block(t, mesh),
                lambda t, spec: expected_shard(t, spec, mesh), tp2d.layernorm2d_comm(B * S, H, q, 2))
    base = build_mesh_3d(q)
    mesh = base.swapped() if swapped else base
    return (f"LayerNorm3D q={q} swapped={swapped}", LayerNorm3D(H, mesh, eps=1e-5, dtype=BF16),
            lambda t: mesh.batch_block(t.detach(), hidden=True).clone(memory_format=torch.contiguous_format),
            lambda t, spec: take_shard(t.detach(), spec, mesh.coords(), mesh.sizes()),
            tp3d.layernorm3d_comm(B * S, H, q, 2, swapped=swapped))


def _bf16_layernorm(mode, q, swapped, seed):
    what, par, blk, shard, volume = _case(mode, q, swapped, seed)
    torch_norm = nn.LayerNorm(H, eps=1e-5, dtype=BF16)          # torch's own bf16 LayerNorm: the yardstick
    with torch.no_grad():
        for name, p in torch_norm.named_parameters():
            p.copy_(randn((H,), seed + len(name)) * 0.5 + (1.0 if name == "weight" else 0.0))
            mine = getattr(par, name)
            mine.copy_(shard(p, get_spec(mine)))
    X = (randn((B, S, H), seed + 10) * 2 + 100).to(BF16)          # mean 100: bf16 spacing 0.5 there
    G = randn((B, S, H), seed + 20).to(BF16)
    # the exact answer: fp32 arithmetic on the same bf16 numbers
    X32 = X.float().requires_grad_()
    w32, b32 = (p.detach().float().requires_grad_() for p in (torch_norm.weight, torch_norm.bias))
    F.layer_norm(X32, (H,), w32, b32, 1e-5).backward(G.float())
    Xt = X.clone().requires_grad_()
    yt = torch_norm(Xt)
    yt.backward(G)
    x = blk(X).requires_grad_()
    LEDGER.reset()
    y = par(x)
    y.backward(blk(G))
    assert y.dtype == BF16 and x.grad.dtype == BF16 and par.weight.grad.dtype == BF16, what
    exact_y = F.layer_norm(X.float(), (H,), w32.detach(), b32.detach(), 1e-5)
    pairs = {"output": (y, blk(yt), blk(exact_y)), "input grad": (x.grad, blk(Xt.grad), blk(X32.grad))}
    for name in ("weight", "bias"):
        spec = get_spec(getattr(par, name))
        pairs[f"{name} grad"] = (getattr(par, name).grad, shard(getattr(torch_norm, name).grad, spec),
                                 shard({"weight": w32, "bias": b32}[name].grad, spec))
    report = {}
    for key, (mine, theirs, exact) in pairs.items():
        err, torch_err = _rel(mine, exact), _rel(theirs, exact)
        report[key] = (err, torch_err)
        # 2×: both round their result to bf16 once; the floor covers a block torch gets exactly right
        assert err <= 2 * torch_err + 1e-3, (what, key, err, torch_err)
    ledger_matches(volume, what)
    return what, report


def test_layernorm2d_in_bf16_is_as_close_as_torch_s_own():
    for what, report in run_on_ranks(4, _bf16_layernorm, "2d", 2, False, fresh_seed()):
        print(what, {k: f"{e:.1e} (torch {t:.1e})" for k, (e, t) in report.items()})


@pytest.mark.wide
@pytest.mark.parametrize("swapped", [False, True], ids=["residual", "swapped"])
def test_layernorm3d_in_bf16_is_as_close_as_torch_s_own(swapped):
    for what, report in run_on_ranks(8, _bf16_layernorm, "3d", 2, swapped, fresh_seed()):
        print(what, {k: f"{e:.1e} (torch {t:.1e})" for k, (e, t) in report.items()})
