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
    # sequence-first storage ([b, s, h] view of a contiguous [s, b, h]): the dim-1 collectives
    # take the copy-free path and keep the layout; values equal the definitions exactly
    seq = [_global((3, 2 * n, 5), 50 + k) for k in range(n)]
    xs = seq[r].transpose(0, 1).contiguous().transpose(0, 1)
    assert not xs.is_contiguous()
    LEDGER.reset()
    g = C.all_gather(xs, ax, 1)
    assert_close(g, torch.cat(seq, 1), 0, "all_gather dim 1, sequence-first")
    assert g.transpose(0, 1).is_contiguous(), f"all_gather lost the sequence-first layout: {g.stride()}"
    rs = C.reduce_scatter(g, ax, 1)
    want = (n * torch.cat(seq, 1)).chunk(n, 1)[r]   # every rank passed the same gathered tensor
    assert_close(rs, want, 1e-12, "reduce_scatter dim 1, sequence-first")
    assert rs.transpose(0, 1).is_contiguous(), f"reduce_scatter lost the sequence-first layout: {rs.stride()}"
    assert LEDGER.payload_bytes("all_gather") == LEDGER.payload_bytes("reduce_scatter") == n * seq[r].numel() * 8
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


def _sp_model_layout(T):
    """In a sequence-parallel Transformer (parallelize, T ranks) every sequence all-gather and
    reduce-scatter, forward and backward, gets its input with the sequence outermost in memory
    (the copy-free path of gridshard.comm.collectives), and the loss equals one device's."""
    import gridshard
    from gridshard.models import ModelConfig, Transformer

    seen = []
    ag, rs = C.all_gather, C.reduce_scatter

    def spy(fn, name):
        def wrapped(x, axis, dim=-1, **kwargs):
            if axis.name == "tensor" and x.dim() == 3:
                seen.append((name, x.movedim(dim % x.dim(), 0).is_contiguous()))
            return fn(x, axis, dim, **kwargs)
        return wrapped

    cfg = ModelConfig(hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=64, vocab_size=50, max_seq_len=16)
    tokens = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(5))
    def plain():
        with torch.device("meta"):
            return Transformer(cfg)

    ref = gridshard.parallelize(plain(), build_mesh(T, 1, 1, "none"), seed=3, device="cpu")
    model = gridshard.parallelize(plain(), build_mesh(1, 1, T, "1d"), sequence_parallel=True, seed=3, device="cpu")
    ref_loss = ref.parallel_context.model_loss(ref, tokens, tokens.roll(-1, 1))
    C.all_gather, C.reduce_scatter = spy(ag, "all_gather"), spy(rs, "reduce_scatter")
    try:
        ctx = model.parallel_context
        loss = ctx.model_loss(model, tokens, tokens.roll(-1, 1))
        loss.backward()
    finally:
        C.all_gather, C.reduce_scatter = ag, rs
    assert_close(loss, ref_loss, 1e-5, "SP loss")
    # embedding RS, per layer 2 AG + 2 RS, head AG; the same again in backward, plus backward's
    # re-gather of each column layer's saved sequence block (2 per layer and the head)
    assert len(seen) == 2 * (2 + 4 * cfg.layers) + 2 * cfg.layers + 1, seen
    assert all(ok for _, ok in seen), f"a sequence collective reordered its input: {seen}"
    return True


@pytest.mark.parametrize("T", [2])
def test_sequence_parallel_collectives_need_no_reorder(T):
    assert all(run_on_ranks(T, _sp_model_layout, T))
