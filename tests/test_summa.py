"""SUMMA products A·B, A·Bᵀ, Aᵀ·B on the q×q grid against dense single-process matmuls.

For q = 2 (several shapes) and q = 3 (one), double-buffered and blocking: the output
block, both operand gradients (each backward is itself two SUMMA products) equal
the blocks of the dense result; the ledger equals gridshard.tensor.tp2d.theory exactly; a
non-2D mesh or mismatched blocks fail before any collective.
"""
import pytest
import torch

from gridshard.comm import LEDGER
from gridshard.tensor.tp2d.summa import summa_ab, summa_abt, summa_atb
from gridshard.errors import LayoutError, ShapeError
from gridshard.mesh import build_mesh
from gridshard.testing import assert_close, run_on_ranks
from gridshard.tensor.tp2d import theory as tp2d

from .test_tp2d_helpers import fresh_seed, ledger_matches, mesh_2d, randn


def _blk(M, mesh):
    return M.detach().chunk(mesh.q, 0)[mesh.grid_row].chunk(mesh.q, 1)[mesh.grid_col].contiguous()


# name: (function, dense reference, (A shape, B shape) from (m, k, n), forward theory, backward theories)
_PRODUCTS = {
    "ab": (summa_ab, lambda a, b: a @ b, lambda m, k, n: ((m, k), (k, n)),
           lambda m, k, n, q: tp2d.summa_ab_comm(m, k, n, q),
           lambda m, k, n, q: tp2d.combine(tp2d.summa_abt_comm(m, n, k, q), tp2d.summa_atb_comm(m, k, n, q))),
    "abt": (summa_abt, lambda a, b: a @ b.t(), lambda m, k, n: ((m, k), (n, k)),
            lambda m, k, n, q: tp2d.summa_abt_comm(m, k, n, q),
            lambda m, k, n, q: tp2d.combine(tp2d.summa_ab_comm(m, n, k, q), tp2d.summa_atb_comm(m, n, k, q))),
    "atb": (summa_atb, lambda a, b: a.t() @ b, lambda m, k, n: ((m, k), (m, n)),
            lambda m, k, n, q: tp2d.summa_atb_comm(m, k, n, q),
            lambda m, k, n, q: tp2d.combine(tp2d.summa_abt_comm(m, n, k, q), tp2d.summa_ab_comm(m, k, n, q))),
}


def _products(q, shapes, overlap, seed):
    mesh = mesh_2d(q)
    for (m, k, n) in shapes:
        for name, (fn, dense, operand_shapes, fwd_theory, bwd_theory) in _PRODUCTS.items():
            what = f"{name} q={q} (m,k,n)=({m},{k},{n}) overlap={overlap} seed={seed}"
            sa, sb = operand_shapes(m, k, n)
            A, B = randn(sa, seed + 1), randn(sb, seed + 2)
            A.requires_grad_(), B.requires_grad_()
            Cref = dense(A, B)
            G = randn(Cref.shape, seed + 3)
            Cref.backward(G)
            a, b = _blk(A, mesh).requires_grad_(), _blk(B, mesh).requires_grad_()
            LEDGER.reset()
            c = fn(a, b, mesh, overlap=overlap)
            # fp32: SUMMA adds q block products in another order than one matmul (~1e-7
            # relative); 1e-5 leaves 100× headroom, a wrong panel or axis is off by O(1)
            assert_close(c, _blk(Cref, mesh), 1e-5, f"{what} forward")
            ledger_matches(fwd_theory(m, k, n, q), f"{what} forward")
            LEDGER.reset()
            c.backward(_blk(G, mesh))
            ledger_matches(bwd_theory(m, k, n, q), f"{what} backward")
            assert_close(a.grad, _blk(A.grad, mesh), 1e-5, f"{what} dA")
            assert_close(b.grad, _blk(B.grad, mesh), 1e-5, f"{what} dB")
    return True


@pytest.mark.parametrize("overlap", [True, False])
def test_summa_products_q2(overlap):
    seed = fresh_seed()
    assert all(run_on_ranks(4, _products, 2, [(4, 6, 8), (10, 2, 6), (6, 8, 2)], overlap, seed))


@pytest.mark.wide
def test_summa_products_q3():
    seed = fresh_seed()
    assert all(run_on_ranks(9, _products, 3, [(6, 9, 3)], True, seed))


def _switch_and_errors():
    """The overlap switch is a layer parameter: Linear2D(overlap=False) issues every SUMMA
    collective blocking, overlap=True asynchronously (forward: the q panel broadcasts per
    operand; backward: the panel all-gathers and the terms' reduce-scatters)."""
    import gridshard.comm.collectives as coll
    from gridshard.tensor.tp2d.linear import Linear2D

    mesh = mesh_2d(2)
    seen = []
    names = ("broadcast", "all_gather", "reduce_scatter")
    real = {n: getattr(coll, n) for n in names}

    def spy(real):
        def call(*args, async_op=False, **kw):
            seen.append(async_op)
            return real(*args, async_op=async_op, **kw)
        return call

    for n in names:
        setattr(coll, n, spy(real[n]))
    try:
        for overlap in (False, True):
            seen.clear()
            layer = Linear2D(8, 4, mesh, bias=False, overlap=overlap)
            layer(torch.randn(3, 4, requires_grad=True)).sum().backward()
            assert len(seen) == 2 * 2 + 4 and all(a == overlap for a in seen), (overlap, seen)   # 2q forward + 4
    finally:
        for n in names:
            setattr(coll, n, real[n])
    LEDGER.reset()
    with pytest.raises(ShapeError, match="summa_ab"):
        summa_ab(torch.zeros(2, 3), torch.zeros(2, 3), mesh)
    with pytest.raises(ShapeError, match="summa_abt"):
        summa_abt(torch.zeros(2, 3), torch.zeros(2, 2), mesh)
    with pytest.raises(ShapeError, match="summa_atb"):
        summa_atb(torch.zeros(2, 3), torch.zeros(3, 2), mesh)
    with pytest.raises(LayoutError, match="tensor_mode='2d'"):
        summa_ab(torch.zeros(2, 2), torch.zeros(2, 2), build_mesh(tensor=4, tensor_mode="1d"))
    assert LEDGER.count() == 0, "an error was raised after a collective"
    return True


def test_overlap_switch_and_errors_before_any_collective():
    assert all(run_on_ranks(4, _switch_and_errors))


def _products_under_autocast(seed):
    """A bf16 activation times an fp32 weight inside torch.autocast (as Linear2D sees it
    after attention in a bf16 run): each product computes in bf16, like autocast's
    matmul, and the fp32 operand's gradient comes back in fp32."""
    mesh = mesh_2d(2)
    for name, (fn, dense, operand_shapes, _, _) in _PRODUCTS.items():
        sa, sb = operand_shapes(8, 6, 4)
        A, B = randn(sa, seed + 1), randn(sb, seed + 2)
        A.requires_grad_(), B.requires_grad_()
        Cref = dense(A, B)
        G = randn(Cref.shape, seed + 3)
        Cref.backward(G)
        a = _blk(A, mesh).to(torch.bfloat16).requires_grad_()
        b = _blk(B, mesh).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c = fn(a, b, mesh)
        assert c.dtype == torch.bfloat16, f"{name}: output {c.dtype}"
        c.backward(_blk(G, mesh).to(torch.bfloat16))
        assert a.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.float32, (name, a.grad.dtype, b.grad.dtype)
        # bf16 has an 8-bit mantissa (unit roundoff 3.9e-3): rounding the operands and the
        # block results costs ~1e-2 relative; 3e-2 allows that, a wrong block is off by O(1)
        assert_close(c.float(), _blk(Cref, mesh), 3e-2, f"{name} autocast forward seed={seed}")
        assert_close(a.grad.float(), _blk(A.grad, mesh), 3e-2, f"{name} autocast dA seed={seed}")
        assert_close(b.grad, _blk(B.grad, mesh), 3e-2, f"{name} autocast dB seed={seed}")
    return True


def test_summa_products_under_bf16_autocast_with_mixed_operand_dtypes():
    seed = fresh_seed()
    assert all(run_on_ranks(4, _products_under_autocast, seed))
