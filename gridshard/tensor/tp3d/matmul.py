"""The 3D matrix products: Y = X·A on a q×q×q cube, with its dual backward (A·Bᵀ, Aᵀ·B).

Layout (rank (i, j, l) = (weight, input, output) coordinates of a :class:`Mesh3D`
orientation, :mod:`gridshard.tensor.tp3d.mesh`; X [M, K] token-major, A [K, N]):

* X: block X_ijl = X[row block i·q + j of q², column block l of q]         [M/q², K/q]
* A: block A_lji = A[row block l·q + i of q², column block j of q]         [K/q², N/q]
* Y: block Y_ijl = Y[row block i·q + l of q², column block j of q]         [M/q², N/q]

i.e. X's row blocks are indexed by (weight, input) and its columns by output; A's rows are
cut by output then weight, its columns by input; Y comes out in the swapped layout (rows by
(weight, output), columns by input), the layout the next layer reads on ``mesh.swapped()``.

Forward (one product, three collectives, no broadcast rounds)::

    X_il = all-gather_input(X_ijl)      rows i·q + 0 … i·q + q − 1, i.e. row block i of q  [M/q, K/q]
    A_lj = all-gather_weight(A_lji)     row block l of q, column block j                   [K/q, N/q]
    P_ijl = X_il · A_lj                 the l-th term of Y[row block i, column block j]   [M/q, N/q]
    Y_ijl = reduce-scatter_output(P)    Σ_l P_ijl, member l keeps row sub-block l         [M/q², N/q]

Backward (dY in Y's layout; every rank holds the same loss, so a rank's incoming gradient is
the exact ∂L/∂(its output block)):

    dY_ij = all-gather_output(dY_ijl)                      the dual of the forward reduce-scatter
    dX_il = dY_ij · A_ljᵀ   (A·Bᵀ),   dX_ijl = reduce-scatter_input(dX_il)   dual of X's all-gather
    dA_lj = X_ilᵀ · dY_ij   (Aᵀ·B),   dA_lji = reduce-scatter_weight(dA_lj)  dual of A's all-gather

Why each backward collective is the dual: the gathered X_il is used by the q members of
``input`` with different A_lj (different j), so ∂L/∂X_il is the sum over them of their
partial gradients, of which member j keeps its own rows: a reduce-scatter. The same holds for
A_lj over ``weight`` (used with different row blocks i of X). The forward reduce-scatter sums
the q partial products and hands out sub-blocks; its adjoint hands every member the whole
∂L/∂Y_ij block: an all-gather. X_il and A_lj are gathered again in backward rather than kept
(keeping them would store q× the input block and q× the weight block per rank); the backward
products are :func:`abt_3d` and :func:`atb_3d`.

Per rank, e bytes per element of the compute dtype (:func:`compute_dtype`; ledger payloads:
gathered output, unscattered input): forward input K·M/q²·e, weight K·N/q²·e (gather), output
M·N/q²·e (reduce-scatter); backward output M·N/q²·e, weight K·N/q²·e (gather; for dX only),
input 2·M·K/q²·e (gather + dX reduce-scatter; the reduce-scatter for dX only), weight K·N/q²·e
(dA reduce-scatter). With every gradient: 8 calls, payload (3·M·K + 2·M·N + 3·K·N)/q²·e, ring
wire (q − 1)/q of it (:func:`gridshard.tensor.tp3d.theory.linear3d_comm`).
"""
from __future__ import annotations

import torch

from ...comm import collectives as C


def abt_3d(g: torch.Tensor, a: torch.Tensor, mesh, g_full: torch.Tensor = None) -> torch.Tensor:
    """dX = dY·Aᵀ in 3D blocks: ``g`` is dY's block [M/q², N/q] (Y's layout), ``a`` A's block
    [K/q², N/q]; returns dX's block [M/q², K/q] (X's layout). Collectives: all-gather of dY on
    ``output`` (M·N/q²·e), of A on ``weight`` (K·N/q²·e), reduce-scatter of the q·(M/q²)×K/q
    product on ``input`` (M·K/q²·e). The dY all-gather is skipped when the caller passes it
    gathered as ``g_full``."""
    if g_full is None:
        g_full = C.all_gather(g, mesh.output, 0)
    a_full = C.all_gather(a, mesh.weight, 0)
    return C.reduce_scatter(g_full @ a_full.t(), mesh.input, 0)


def atb_3d(x: torch.Tensor, g: torch.Tensor, mesh, g_full: torch.Tensor = None) -> torch.Tensor:
    """dA = Xᵀ·dY in 3D blocks: ``x`` X's block [M/q², K/q], ``g`` dY's block [M/q², N/q];
    returns A's block [K/q², N/q]. Collectives: all-gather of X on ``input`` (M·K/q²·e), of dY on
    ``output`` (M·N/q²·e, skipped when the caller passes it gathered as ``g_full``),
    reduce-scatter of the K/q × N/q product on ``weight`` (K·N/q²·e)."""
    x_full = C.all_gather(x, mesh.input, 0)
    if g_full is None:
        g_full = C.all_gather(g, mesh.output, 0)
    return C.reduce_scatter(x_full.t() @ g_full, mesh.weight, 0)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product runs in: autocast's where it is on for ``x``'s device (as autocast runs a
    matmul), else ``x``'s. The product casts its operands to it *before* their gathers, so X and A
    travel in it (2 bytes under bf16/fp16 autocast over fp32 parameters, as under bf16 storage), and
    its backward runs in it too: autograd calls a backward outside autocast, where a bf16 dY would
    meet the fp32 parameter block it saved (the casts' gradients go back to the saved dtypes)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _joined(parts) -> torch.Tensor:
    """The parts' blocks side by side [K/q², Σ N_k/q] (the one part itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class _MatmulAB3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, *parts):
        ctx.save_for_backward(x, *parts)          # the parts themselves, not their concatenation
        ctx.mesh, ctx.dtype = mesh, compute_dtype(x)
        x_full = C.all_gather(x.to(ctx.dtype), mesh.input, 0)
        a_full = C.all_gather(_joined(parts).to(ctx.dtype), mesh.weight, 0)
        return C.reduce_scatter(x_full @ a_full, mesh.output, 0)

    @staticmethod
    def backward(ctx, g):
        x, *parts = ctx.saved_tensors
        mesh, dtype = ctx.mesh, ctx.dtype
        g = g.contiguous().to(dtype)
        g_full = C.all_gather(g, mesh.output, 0)
        dx, dparts = None, [None] * len(parts)
        if ctx.needs_input_grad[0]:
            dx = abt_3d(g, _joined(parts).to(dtype), mesh, g_full).to(x.dtype)
        if any(ctx.needs_input_grad[2:]):
            da = atb_3d(x.to(dtype), g, mesh, g_full)
            dparts = [da] if len(parts) == 1 else [d.contiguous() for d in da.split([p.shape[1] for p in parts], 1)]
            dparts = [d.to(p.dtype) for d, p in zip(dparts, parts)]
        return dx, None, *dparts


def matmul_3d(x: torch.Tensor, a: torch.Tensor, mesh) -> torch.Tensor:
    """Y = X·A in 3D blocks (module docstring): ``x`` [M/q², K/q] in ``mesh``'s layout, ``a``
    [K/q², N/q]; returns [M/q², N/q] in ``mesh.swapped()``'s layout. Backward: the dual
    collectives, dX and dA each reduce-scattered to their owners."""
    return _MatmulAB3D.apply(x.contiguous(), mesh, a)


def matmul_3d_parts(x: torch.Tensor, parts, mesh) -> torch.Tensor:
    """Y = X·[A₀ | A₁ | …] in 3D blocks from the parts' blocks [K/q², N_k/q] → [M/q², Σ N_k/q]
    (columns: part 0's output block j, then part 1's, …), each part's slice what
    :func:`matmul_3d` of that part alone returns.

    Why it moves less: the parts read one X, so X_il is gathered once (forward and again for
    dA), dX is one reduce-scatter of the summed Σ_k dY_k·A_kᵀ, and the weight gathers and dY
    gathers become one call each of the joined width: the eight calls of one product of width
    Σ N_k, (3·M·K + 2·M·ΣN + 3·K·ΣN)/q²·e, instead of 8 per part with 3·M·K/q²·e each
    (:func:`gridshard.tensor.tp3d.theory.linear3d_comm` on Σ N_k). The concatenation rides along
    the gathers because A's all-gather over ``weight`` stacks row blocks and the parts differ
    only in columns. Autograd keeps the parts (parameters), not the joined block; dA is split
    back into the parts' gradients."""
    return _MatmulAB3D.apply(x.contiguous(), mesh, *parts)
