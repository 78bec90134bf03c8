"""One MoE layer with its experts split over E expert ranks (gridshard/moe/dispatch.py) against the
same layer whole on every rank: outputs, token gradients and expert gradients, for both dispatchers,
with capacity drops and a rank whose experts get no token; and the ledger's bytes and calls of one
layer equal to the closed form (gridshard/theory/moe.py). Fresh random inputs on every rank."""
import copy

import pytest
import torch
import torch.distributed as dist

from gridshard.comm import collectives as C
from gridshard.comm.ledger import CommLedger
from gridshard.moe.layer import MoEBlock
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error
from gridshard.theory.moe import dispatch_volume

H, N_EXP, K, FFN = 12, 8, 2, 16


def _body(world, expert, kind, capacity, starve, tokens):
    from gridshard.mesh import build_mesh

    ledger = CommLedger()
    mesh = build_mesh(world, ledger=ledger, expert=expert)
    torch.manual_seed(0)                                   # the same whole layer on every rank
    whole = MoEBlock(H, N_EXP, K, FFN, capacity=capacity)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if starve is not None:                                 # rank `starve`'s experts get no token
        first = starve * N_EXP // expert
        whole.gate.expert_bias[first:first + N_EXP // expert] = -1e9
    split = copy.deepcopy(whole)
    split.split_experts(mesh.expert, kind)
    lo, n_l = mesh.expert.rank * N_EXP // expert, N_EXP // expert
    for name in ("gate_up_proj", "down_proj"):
        setattr(split.experts, name, torch.nn.Parameter(getattr(whole.experts, name)[lo:lo + n_l].detach().clone()))
    torch.manual_seed(100 + dist.get_rank())               # fresh tokens per rank, a different count per rank
    n_seq = tokens[mesh.expert.rank % len(tokens)]
    x = torch.randn(n_seq, 6, H)
    probe = torch.randn(n_seq, 6, H)
    xs, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    ledger.reset()
    (split(xs) * probe).sum().backward()
    seen = {op: (ledger.count(op, "expert"), ledger.payload_bytes(op, "expert"))
            for op in ("all_gather", "all_to_all_v", "reduce_scatter")}
    with ledger.paused():
        y_whole = whole(xw)
        (y_whole * probe).sum().backward()
        routing = whole.gate(x.reshape(-1, H), 6)
        load = torch.bincount(routing.experts.flatten()[routing.kept.flatten()], minlength=N_EXP)
        counts = C.all_gather(torch.cat([load, load.new_tensor([n_seq * 6])]).unsqueeze(0), mesh.expert, 0)
        grads = {n: C.all_reduce(getattr(whole.experts, n).grad, mesh.expert)[lo:lo + n_l]
                 for n in ("gate_up_proj", "down_proj")}
    want = dispatch_volume(kind, counts[:, :-1].tolist(), counts[:, -1].tolist(), mesh.expert.rank, H, K, 4)
    with torch.no_grad():
        y_split = split(x)
    return {"y": relative_error(y_split, y_whole.detach()), "dx": relative_error(xs.grad, xw.grad),
            "router": relative_error(split.gate.weight.grad, whole.gate.weight.grad),
            "experts": max(relative_error(getattr(split.experts, n).grad, g) for n, g in grads.items()),
            "seen": {op: v for op, v in seen.items() if v[0]}, "want": want, "load": load.tolist()}


@pytest.mark.parametrize("world,expert,kind,capacity,starve", [
    (4, 4, "all_to_all", None, None), (2, 2, "all_gather", 1.0, None), (4, 2, "all_to_all", 1.0, 1),
    pytest.param(4, 4, "all_gather", None, 3, marks=pytest.mark.wide)])
def test_split_layer_matches_the_whole_layer_and_the_closed_form(world, expert, kind, capacity, starve):
    per_rank = run_on_ranks(world, _body, world, expert, kind, capacity, starve, (2, 3), timeout=120)
    for rank, got in enumerate(per_rank):
        # the router's gradient is a sum over this rank's tokens only: the same terms, other rounding
        assert max(got[k] for k in ("y", "dx", "router", "experts")) < 1e-5, (rank, got)
        assert got["seen"] == got["want"], (rank, got["seen"], got["want"])
    if starve is not None:
        first = starve * N_EXP // expert
        assert all(sum(r["load"][first:first + N_EXP // expert]) == 0 for r in per_rank)
