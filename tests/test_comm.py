"""Recorded collectives and the dual autograd functions against their definitions."""
import pytest
import torch

from gridshard.comm import (LEDGER, copy_to_group, gather_from_group, gather_sequence, reduce_from_group,
                            reduce_scatter_sequence, scatter_to_group)
from gridshard.comm import collectives as C
from gridshard.mesh import build_mesh
from gridshard.testing import assert_close, run_on_ranks


def _global(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _collectives(n):
    m = build_mesh(tensor=n)
    ax, r = m.tensor, m.tensor.rank
    per_rank = [_global((4, 6, 2 * n), 10 + k) for k in range(n)]
    x = per_rank[r]
    # float64 data: gathers and broadcasts are copies (tolerance 0); a reduction may add the n ≤ 4
    # terms in another order than sum(), a few float64 ulps (~1e-16) apart, so 1e-12 is ample
    assert_close(C.all_reduce(x, ax), sum(per_rank), 1e-12, "all_reduce")
    for dim in (0, 1, 2):
        assert_close(C.all_gather(x, ax, dim), torch.cat(per_rank, dim), 0, f"all_gather dim {dim}")
    assert_close(C.reduce_scatter(x, ax, 2), sum(per_rank).chunk(n, 2)[r], 1e-12, "reduce_scatter dim 2")
    assert_close(C.reduce_scatter(x.transpose(0, 2).contiguous(), ax, 0),
                 sum(per_rank).transpose(0, 2).chunk(n, 0)[r], 1e-12, "reduce_scatter dim 0")
    b = x.clone() if r == n - 1 else torch.empty_like(x)
    assert_close(C.broadcast(b, ax, n - 1, async_op=True).wait(), per_rank[-1], 0, "broadcast")
    nbytes = x.numel() * 8
    assert LEDGER.count("all_gather") == 3 and LEDGER.payload_bytes("all_gather") == 3 * n * nbytes
    assert LEDGER.payload_bytes("reduce_scatter") == 2 * nbytes
    assert LEDGER.payload_bytes("all_reduce") == nbytes and LEDGER.payload_bytes("broadcast") == nbytes
    # wire bytes one rank sends on a ring of n, written out here (not through ring_wire_bytes):
    # all-reduce = reduce-scatter + all-gather, each moving n−1 of the n chunks of B
    chunk = nbytes / n
    wire = {"all_gather": 3 * (n - 1) * nbytes,            # 3 calls; each gathers n·B, sends (n−1) blocks of B
            "reduce_scatter": 2 * (n - 1) * chunk,         # 2 calls of B: (n−1) chunks of B/n each
            "all_reduce": 2 * (n - 1) * chunk,             # reduce-scatter then all-gather of B
            "broadcast": (n - 1) * chunk}                  # pipelined: B in n chunks, n−1 sent per rank
    for op, want in wire.items():
        # the ledger accumulates floats of (n−1)/n·B: equal to within float rounding
        assert LEDGER.total("wire_bytes", op) == pytest.approx(want, rel=1e-12), \
            f"{op} wire bytes {LEDGER.total('wire_bytes', op)} != {want}"
    return True


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_match_definitions_and_ledger(n):
    assert all(run_on_ranks(n, _collectives, n))


def _duals(n):
    """Each dual function's backward equals the vector-Jacobian product of the global map.

    Global view: the input is either replicated (one tensor X, the same on every rank)
    or partitioned (X_k on rank k); the output is either replicated (every rank holds
    the same Y and sees the same upstream gradient G) or per-rank (Y_k, used
    differently on each rank, gradient G_k). The loss is L = Σ_k <Y_k, G_k>.
    """
    m = build_mesh(tensor=n)
    ax, r = m.tensor, m.tensor.rank
    xs = [_global((2, 2 * n, 3 * n), 100 + k) for k in range(n)]
    cases = {
        # name: (fn, input replicated?, output replicated?, global map from inputs to per-rank outputs)
        "copy": (lambda x: copy_to_group(x, ax), True, False, lambda X: [X[0]] * n),
        "reduce": (lambda x: reduce_from_group(x, ax), False, True, lambda X: [sum(X)] * n),
        "scatter": (lambda x: scatter_to_group(x, ax, -1), True, False, lambda X: list(X[0].chunk(n, -1))),
        "gather": (lambda x: gather_from_group(x, ax, 1), False, True, lambda X: [torch.cat(X, 1)] * n),
        "gather_seq": (lambda x: gather_sequence(x, ax, 1), False, False, lambda X: [torch.cat(X, 1)] * n),
        "reduce_scatter_seq": (lambda x: reduce_scatter_sequence(x, ax, 1), False, False,
                               lambda X: list(sum(X).chunk(n, 1))),
    }
    for name, (fn, rep_in, rep_out, ref) in cases.items():
        X = [xs[0].clone().requires_grad_()] if rep_in else [t.clone().requires_grad_() for t in xs]
        Y = ref(X * n if rep_in else X)
        G = [_global(Y[k].shape, 300 + (0 if rep_out else k)) for k in range(n)]
        if rep_out:
            Y[0].backward(G[0])
        else:
            torch.autograd.backward(Y, G)
        x = (xs[0] if rep_in else xs[r]).clone().requires_grad_()
        y = fn(x)
        y.backward(G[r])
        # float64; only the order of a sum of n ≤ 4 terms can differ from the reference (see above)
        assert_close(y, Y[r], 1e-12, f"{name} forward")
        assert_close(x.grad, X[0 if rep_in else r].grad, 1e-12, f"{name} backward")
    return True


@pytest.mark.parametrize("n", [2, 4])
def test_dual_functions_backward_is_adjoint(n):
    assert all(run_on_ranks(n, _duals, n))
