"""SUMMA matrix products on the q×q tensor grid, as autograd functions.

Block convention (rank (i, j) = ``mesh.grid_row``, ``mesh.grid_col``; ``mesh.row`` is
the group of my grid row, indexed by column j; ``mesh.col`` the group of my grid
column, indexed by row i). Every matrix M is split into q×q equal blocks and rank
(i, j) holds block M(i, j). All blocks of one matrix have the same shape, so a
receiver allocates the sender's block shape from its own block.

Three products (global shapes; every operand and result stays in blocks, no rank
ever holds a full operand):

``summa_ab``   C[m, n] = A[m, k] · B[k, n]
    q steps; step t: A(i, t) is broadcast along row i (source: column t),
    B(t, j) along column j (source: row t); every rank accumulates
    C(i, j) += A(i, t) · B(t, j). Double buffering: the broadcasts of step t+1 are
    issued (async) before the multiply of step t.
``summa_abt``  C[m, n] = A[m, k] · B[n, k]ᵀ
    q steps; step t computes output column block t: B(t, j) is broadcast along
    column j (source: row t); rank (i, j) forms A(i, j) · B(t, j)ᵀ, the j-th term of
    C(i, t) = Σ_j A(i, j) B(t, j)ᵀ, and the terms are reduced along row i into
    member t. The next step's broadcast is issued before the current multiply.
``summa_atb``  C[k, n] = A[m, k]ᵀ · B[m, n]
    q steps; step t computes output row block t: A(i, t) is broadcast along row i
    (source: column t); rank (i, j) forms A(i, t)ᵀ · B(i, j), the i-th term of
    C(t, j) = Σ_i A(i, t)ᵀ B(i, j), reduced along column j into member t.

Backward passes are the same three products (Cotangent g of C):

* C = A·B:   dA = g·Bᵀ (abt), dB = Aᵀ·g (atb)
* C = A·Bᵀ:  dA = g·B (ab),   dB = gᵀ·A (atb with (g, A))
* C = Aᵀ·B:  dA = B·gᵀ (abt with (B, g)), dB = A·g (ab)

Payload per rank (ledger convention, e = bytes per element), for one product:

* ab:  q broadcasts on the row of m/q·k/q·e and q on the column of k/q·n/q·e;
* abt: q broadcasts on the column of n/q·k/q·e and q reduces on the row of m/q·n/q·e;
* atb: q broadcasts on the row of m/q·k/q·e and q reduces on the column of k/q·n/q·e.

So every product is 2q collective calls per rank; a linear layer forward+backward
(ab forward, abt + atb backward) is 6q calls: the 6(q−1) latency term of the SUMMA
cost table counts the q−1 of each q that a rank receives rather than sends. The
closed forms live in :mod:`gridshard.theory.tp2d`.

Overlap switch: ``overlap=False`` (per call; :class:`gridshard.nn.linear_2d.Linear2D`
and the 2D heads take it as a constructor argument, ``parallelize(summa_overlap=...)``
and the config key ``parallel.summa_overlap`` set it for a model) makes every broadcast
and reduce blocking, the benchmark's baseline. A forward's setting is also used by its
backward. There is no process-wide switch.
"""
from __future__ import annotations


import torch

from ..errors import ShapeError
from . import collectives as C

def _panel(x: torch.Tensor, axis, src: int, overlap: bool):
    """Broadcast member ``src``'s block along ``axis``; the source sends its own ``x``,
    the others receive into a buffer of the same shape. Returns an object with ``wait()``."""
    buf = x if axis.rank == src else torch.empty_like(x)
    if overlap:
        return C.broadcast(buf, axis, src, async_op=True)
    return C.PendingCollective(None, C.broadcast(buf, axis, src), None)


def _reduce_to(x: torch.Tensor, axis, dst: int, overlap: bool):
    if overlap:
        return C.reduce(x, axis, dst, async_op=True)
    return C.PendingCollective(None, C.reduce(x, axis, dst), None)


def _check(cond: bool, what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or not cond:
        raise ShapeError(f"{what}: local blocks of shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit: "
                         f"both must be 2-D with matching contracted block sizes. Fix: check that every "
                         f"operand is split into q×q equal blocks along the documented dims.")


def _ab(a: torch.Tensor, b: torch.Tensor, row, col, overlap: bool) -> torch.Tensor:
    """C(i, j) = Σ_t A(i, t) · B(t, j)."""
    _check(a.shape[1] == b.shape[0], "summa_ab", a, b)
    q = row.size
    a, b = a.contiguous(), b.contiguous()
    out = a.new_zeros(a.shape[0], b.shape[1])
    pending = (_panel(a, row, 0, overlap), _panel(b, col, 0, overlap))
    for t in range(q):
        nxt = (_panel(a, row, t + 1, overlap), _panel(b, col, t + 1, overlap)) if t + 1 < q else None
        out.addmm_(pending[0].wait(), pending[1].wait())
        pending = nxt
    return out


def _abt(a: torch.Tensor, b: torch.Tensor, row, col, overlap: bool) -> torch.Tensor:
    """C(i, t) = Σ_j A(i, j) · B(t, j)ᵀ, reduced along row i into member t."""
    _check(a.shape[1] == b.shape[1], "summa_abt", a, b)
    q = row.size
    a, b = a.contiguous(), b.contiguous()
    mine, in_flight = None, None
    pending = _panel(b, col, 0, overlap)
    for t in range(q):
        nxt = _panel(b, col, t + 1, overlap) if t + 1 < q else None
        part = a @ pending.wait().t()
        red = _reduce_to(part, row, t, overlap)
        if in_flight is not None:
            in_flight.wait()
        in_flight = red
        if row.rank == t:
            mine = red
        pending = nxt
    in_flight.wait()
    return mine.wait()


def _atb(a: torch.Tensor, b: torch.Tensor, row, col, overlap: bool) -> torch.Tensor:
    """C(t, j) = Σ_i A(i, t)ᵀ · B(i, j), reduced along column j into member t."""
    _check(a.shape[0] == b.shape[0], "summa_atb", a, b)
    q = row.size
    a, b = a.contiguous(), b.contiguous()
    mine, in_flight = None, None
    pending = _panel(a, row, 0, overlap)
    for t in range(q):
        nxt = _panel(a, row, t + 1, overlap) if t + 1 < q else None
        part = pending.wait().t() @ b
        red = _reduce_to(part, col, t, overlap)
        if in_flight is not None:
            in_flight.wait()
        in_flight = red
        if col.rank == t:
            mine = red
        pending = nxt
    in_flight.wait()
    return mine.wait()


class _SummaAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, row, col, overlap):
        ctx.save_for_backward(a, b)
        ctx.axes, ctx.overlap = (row, col), overlap
        return _ab(a, b, row, col, overlap)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        row, col = ctx.axes
        da = _abt(g, b, row, col, ctx.overlap) if ctx.needs_input_grad[0] else None
        db = _atb(a, g, row, col, ctx.overlap) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


class _SummaABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, row, col, overlap):
        ctx.save_for_backward(a, b)
        ctx.axes, ctx.overlap = (row, col), overlap
        return _abt(a, b, row, col, overlap)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        row, col = ctx.axes
        da = _ab(g, b, row, col, ctx.overlap) if ctx.needs_input_grad[0] else None
        db = _atb(g, a, row, col, ctx.overlap) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


class _SummaATB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, row, col, overlap):
        ctx.save_for_backward(a, b)
        ctx.axes, ctx.overlap = (row, col), overlap
        return _atb(a, b, row, col, overlap)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        row, col = ctx.axes
        da = _abt(b, g, row, col, ctx.overlap) if ctx.needs_input_grad[0] else None
        db = _ab(a, g, row, col, ctx.overlap) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


class _SummaABParts(torch.autograd.Function):
    """A·[B₀ | B₁ | …]: one SUMMA product with the parts joined along the columns, saving the
    parts themselves (parameters: no copy), not the joined matrix; the join is rebuilt in
    backward. dA = dC·Bᵀ (ABᵀ), dB = Aᵀ·dC (AᵀB) split back into the parts."""

    @staticmethod
    def forward(ctx, a, row, col, overlap, *parts):
        ctx.save_for_backward(a, *parts)
        ctx.axes, ctx.overlap = (row, col), overlap
        return _ab(a, torch.cat(parts, 1), row, col, overlap)

    @staticmethod
    def backward(ctx, g):
        a, *parts = ctx.saved_tensors
        row, col = ctx.axes
        da = _abt(g, torch.cat(parts, 1), row, col, ctx.overlap) if ctx.needs_input_grad[0] else None
        db = _atb(a, g, row, col, ctx.overlap).split([p.shape[1] for p in parts], 1)
        return (da, None, None, None, *db)


def summa_ab_parts(a: torch.Tensor, parts, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·[B₀ | B₁ | …] from A(i, j) and the parts' blocks B_k(i, j) [k/q, n_k/q]
    → [m/q, Σ n_k/q]: the communication of one product of width Σ n_k, without keeping the
    joined weight between forward and backward."""
    row, col = _grid(mesh)
    if torch.is_autocast_enabled(a.device.type):
        dtype = torch.get_autocast_dtype(a.device.type)
        a, parts = a.to(dtype), [p.to(dtype) for p in parts]
    return _SummaABParts.apply(a, row, col, overlap, *parts)


def _autocast_operands(a: torch.Tensor, b: torch.Tensor):
    """Inside ``torch.autocast``, cast both operands to the autocast dtype, as autocast does
    for a matmul: a bf16 activation then meets a bf16 copy of an fp32 weight (the in-place
    ``addmm_`` of :func:`_ab` is not autocast and would reject mixed dtypes), the panels
    travel in the low precision, and the casts carry the gradients back to fp32."""
    dev = a.device.type
    if not torch.is_autocast_enabled(dev):
        return a, b
    dtype = torch.get_autocast_dtype(dev)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (a, b))


def _grid(mesh):
    if getattr(mesh, "q", None) is None:
        from ..errors import LayoutError

        raise LayoutError(f"SUMMA needs a 2D mesh, got tensor_mode={mesh.tensor_mode!r}. "
                          f"Fix: build_mesh(..., tensor=q*q, tensor_mode='2d').")
    return mesh.row, mesh.col


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·B from blocks A(i, j) [m/q, k/q] and B(i, j) [k/q, n/q]; → [m/q, n/q]."""
    row, col = _grid(mesh)
    a, b = _autocast_operands(a, b)
    return _SummaAB.apply(a, b, row, col, overlap)


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·Bᵀ from A(i, j) [m/q, k/q] and B(i, j) [n/q, k/q]; → [m/q, n/q]."""
    row, col = _grid(mesh)
    a, b = _autocast_operands(a, b)
    return _SummaABT.apply(a, b, row, col, overlap)


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of Aᵀ·B from A(i, j) [m/q, k/q] and B(i, j) [m/q, n/q]; → [k/q, n/q]."""
    row, col = _grid(mesh)
    a, b = _autocast_operands(a, b)
    return _SummaATB.apply(a, b, row, col, overlap)
