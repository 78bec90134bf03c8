"""Context parallelism's attention against plain causal attention on the whole sequence.

The sequence is split load-balanced over C ranks (rank i: chunks i and 2C − 1 − i); every
rank's output rows and its q/k/v gradients equal those rows of F.scaled_dot_product_attention
(causal, grouped-query) on the global tensors within 1e-5 (fp32), and the ledger's sends equal
gridshard.theory.context.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gridshard.comm.ledger import CommLedger, use_ledger
from gridshard.context import all_to_all_attention, global_positions, ring_attention, shard_sequence, unshard_sequence
from gridshard.context.sequence_split import check_divisible
from gridshard.mesh import Axis
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error
from gridshard.theory.context import all_to_all_attention_volume, ring_attention_sends

TOL = 1e-5


def test_split_round_trips_and_positions_are_global():
    x = torch.arange(2 * 24).view(2, 24)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    assert torch.equal(unshard_sequence(parts), x)
    for r in range(3):     # the positions of the tokens a rank holds are their global indices
        assert torch.equal(parts[r][0], global_positions(8, 3, r))
    # balanced causal work: rank i's chunks attend to (i + 1) + (2C - i) chunks, the same for all
    assert {(r + 1) + (2 * 3 - r) for r in range(3)} == {7}
    with pytest.raises(ValueError, match="multiple of 6"):
        check_divisible(20, 3)


def _case(mode, b, S, H, H_kv, d, seed):
    op = "send" if mode == "ring" else "all_to_all"
    C, r = dist.get_world_size(), dist.get_rank()
    axis = Axis("context", C, r, tuple(range(C)), dist.group.WORLD)
    g = torch.Generator().manual_seed(seed)
    Q, K, V, G = (torch.randn(b, h, S, d, generator=g) for h in (H, H_kv, H_kv, H))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    ref = F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=H != H_kv)
    ref.backward(G)
    q, k, v = (shard_sequence(t.detach(), C, r, dim=2).requires_grad_() for t in (Q, K, V))
    ledger = CommLedger()
    with use_ledger(ledger):
        out = (ring_attention if mode == "ring" else all_to_all_attention)(q, k, v, axis)
        fwd = (ledger.count(op), ledger.payload_bytes(op))
        out.backward(shard_sequence(G, C, r, dim=2))
    total = (ledger.count(op), ledger.payload_bytes(op))
    wire_ok = ledger.total("wire_bytes", op=op) == (total[1] if mode == "ring" else (C - 1) / C * total[1])
    theory = (ring_attention_sends if mode == "ring" else all_to_all_attention_volume)(C, b, S // C, H, H_kv, d, 4)
    bwd = (total[0] - fwd[0], total[1] - fwd[1])
    errs = {}
    for name, mine, want in (("out", out, ref), ("dq", q.grad, Q.grad), ("dk", k.grad, K.grad),
                             ("dv", v.grad, V.grad)):
        errs[name] = relative_error(mine, shard_sequence(want.detach(), C, r, dim=2))
    return errs, fwd == theory["forward"] and wire_ok, bwd == theory["backward"]


@pytest.mark.parametrize("mode,H,H_kv", [("ring", 4, 2), ("ring", 2, 2), ("all_to_all", 8, 4)])
def test_context_attention_matches_causal_attention(mode, H, H_kv):
    for errs, fwd_ok, bwd_ok in run_on_ranks(4, _case, mode, 2, 16, H, H_kv, 8, seed=7 + H_kv):
        assert fwd_ok and bwd_ok
        assert max(errs.values()) <= TOL, errs
