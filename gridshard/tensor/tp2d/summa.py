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
    C(i, t) = Σ_j A(i, j) B(t, j)ᵀ. Rank (i, j) all-gathers B(0, j) … B(q−1, j) along
    column j (one call), forms the q terms A(i, j) · B(t, j)ᵀ into one buffer
    [q, m/q, n/q] (term t written by its GEMM into slot t) and reduce-scatters them along row i: member t
    receives C(i, t). Two calls, where a sweep of q broadcasts + q reduces took 2q.
``summa_atb``  C[k, n] = A[m, k]ᵀ · B[m, n]
    C(t, j) = Σ_i A(i, t)ᵀ B(i, j). Rank (i, j) all-gathers A(i, 0) … A(i, q−1) along
    row i, forms the q terms A(i, t)ᵀ · B(i, j) [q, k/q, n/q] and reduce-scatters them
    along column j: member t receives C(t, j). Two calls.

The slot dim of the gathered panels and of the terms is the outermost, so neither
collective copies (all-gather and reduce-scatter on dim 0). The price is a transient of
q blocks per operand and q output blocks (the sweep held one or two); the sums are the
same (the reduce-scatter adds the same q terms the reduces added, in the backend's order).

Backward passes are the same three products (Cotangent g of C):

* C = A·B:   dA = g·Bᵀ (abt), dB = Aᵀ·g (atb)
* C = A·Bᵀ:  dA = g·B (ab),   dB = gᵀ·A (atb with (g, A))
* C = Aᵀ·B:  dA = B·gᵀ (abt with (B, g)), dB = A·g (ab)

Payload per rank (ledger convention, e = bytes per element; all-gather: the gathered
output, reduce-scatter: the unscattered input), for one product:

* ab:  q broadcasts on the row of m/q·k/q·e and q on the column of k/q·n/q·e (2q calls);
* abt: 1 all-gather on the column of q·n/q·k/q·e and 1 reduce-scatter on the row of
  q·m/q·n/q·e (2 calls);
* atb: 1 all-gather on the row of q·m/q·k/q·e and 1 reduce-scatter on the column of
  q·k/q·n/q·e (2 calls).

The payloads equal those of the q broadcasts / q reduces they replace, and so do the ring
wire bytes ((q−1)/q of the payload either way). A linear layer forward+backward (ab
forward, abt + atb backward) is 2q + 4 calls (was 6q). The closed forms live in
:mod:`gridshard.tensor.tp2d.theory`.

Overlap switch: ``overlap=False`` (per call; :class:`gridshard.tensor.tp2d.linear.Linear2D`
and the 2D heads take it as a constructor argument, ``parallelize(summa_overlap=...)``
and the config key ``parallel.summa_overlap`` set it for a model) makes the broadcasts of
A·B blocking (the benchmark's baseline) and the backward of A·B run its two products one
after the other with blocking calls. With overlap (the default) the backward of A·B
(:func:`_ab_backward`, every Linear2D's) issues both panel all-gathers at once, computes
each product's own term while they travel, and runs dA's reduce-scatter during dB's GEMMs;
a standalone A·Bᵀ or Aᵀ·B product is blocking either way. A forward's setting is also used by its
backward. There is no process-wide switch.
"""
from __future__ import annotations

import torch

from ...errors import ShapeError
from ...comm import collectives as C


@C.eager
def _panel(x: torch.Tensor, axis, src: int, overlap: bool):
    """Broadcast member ``src``'s block along ``axis``; the source sends its own ``x``,
    the others receive into a buffer of the same shape. Returns an object with ``wait()``. Eager
    under ``train.compile`` (:func:`gridshard.comm.collectives.eager`): traced, its source index,
    its Parameter or activation operand and the handle it returns recompiled it past torch's limit."""
    buf = x if axis.rank == src else torch.empty_like(x)
    if overlap:
        return C.broadcast(buf, axis, src, async_op=True)
    return C.PendingCollective(None, C.broadcast(buf, axis, src), None)


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


def _gather_panels(x: torch.Tensor, axis) -> torch.Tensor:
    """All-gather the blocks of one grid row (or column) along ``axis``: [q, *block], member t's
    block at index t. One call; payload q·block (the q broadcasts of the panel sweep)."""
    return C.all_gather(x.unsqueeze(0), axis, 0)


def _reduce_scatter_terms(terms: torch.Tensor, axis) -> torch.Tensor:
    """terms [q, *block] on every member, term t destined to member t → my Σ_members term[me].
    One call; payload q·block (the q reduces of the term sweep)."""
    return C.reduce_scatter(terms, axis, 0)[0]


def _abt(a: torch.Tensor, b: torch.Tensor, row, col, overlap: bool) -> torch.Tensor:
    """C(i, t) = Σ_j A(i, j) · B(t, j)ᵀ: one column all-gather, q GEMMs into one buffer, one row
    reduce-scatter.

    Rank (i, j) gathers the q blocks B(0, j) … B(q−1, j) of its grid column ([q, n/q, k/q],
    one call), forms all q terms A(i, j)·B(t, j)ᵀ at once ([q, m/q, n/q], term t in slot t:
    the slot dim is the outermost, so the buffer is already in reduce-scatter order) and
    reduce-scatters them along row i: member t receives Σ_j term t = C(i, t). Same payload
    as q broadcasts + q reduces, 2 calls instead of 2q; transient q·(n·k + m·n)/q² elements.
    ``overlap`` has no effect here (both collectives are single blocking calls)."""
    _check(a.shape[1] == b.shape[1], "summa_abt", a, b)
    panels = _gather_panels(b.contiguous(), col)                 # [q, n/q, k/q]
    terms = a.new_empty(panels.shape[0], a.shape[0], panels.shape[1])   # [q, m/q, n/q], slot t = term t
    for t in range(panels.shape[0]):                             # q GEMMs straight into the slots: no copies
        torch.mm(a, panels[t].t(), out=terms[t])
    return _reduce_scatter_terms(terms, row)


def _atb(a: torch.Tensor, b: torch.Tensor, row, col, overlap: bool) -> torch.Tensor:
    """C(t, j) = Σ_i A(i, t)ᵀ · B(i, j): one row all-gather, q GEMMs into one buffer, one column
    reduce-scatter.

    Rank (i, j) gathers A(i, 0) … A(i, q−1) along row i ([q, m/q, k/q], one call), forms the
    q terms A(i, t)ᵀ·B(i, j) ([q, k/q, n/q], term t in slot t) and reduce-scatters them along
    column j: member t receives Σ_i term t = C(t, j). 2 calls instead of 2q (see :func:`_abt`)."""
    _check(a.shape[0] == b.shape[0], "summa_atb", a, b)
    panels = _gather_panels(a.contiguous(), row)                 # [q, m/q, k/q]
    b = b.contiguous()
    terms = b.new_empty(panels.shape[0], panels.shape[2], b.shape[1])   # [q, k/q, n/q], slot t = term t
    for t in range(panels.shape[0]):
        torch.mm(panels[t].t(), b, out=terms[t])
    return _reduce_scatter_terms(terms, col)


def _ab_backward(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row, col, need_a: bool, need_b: bool,
                 overlap: bool):
    """(dA, dB) of C = A·B: dA = g·Bᵀ (:func:`_abt`), dB = Aᵀ·g (:func:`_atb`); None where not needed.

    With ``overlap`` the two products' four collectives run while the GEMMs do: both panel
    all-gathers (B along the column, A along the row) are issued first, asynchronously; each
    product's own term (the block this rank already holds: B(i, j) is slot i of the column,
    A(i, j) slot j of the row) is computed while they travel; the other q − 1 terms follow
    when the panels arrive, and dA's reduce-scatter along the row runs while dB's terms are
    computed. Every rank issues the same calls in the same order on each group (row: gather A,
    reduce-scatter dA; column: gather B, reduce-scatter dB). The same calls, payloads and
    sums as the two blocking products, which ``overlap=False`` runs one after the other."""
    if not overlap:
        return (_abt(g, b, row, col, False) if need_a else None, _atb(a, g, row, col, False) if need_b else None)
    g, a, b = g.contiguous(), a.contiguous(), b.contiguous()
    _check(g.shape[1] == b.shape[1], "summa_abt", g, b)
    _check(a.shape[0] == g.shape[0], "summa_atb", a, g)
    q = row.size
    gather_b = C.all_gather(b.unsqueeze(0), col, 0, async_op=True) if need_a else None    # [q, k/q, n/q]
    gather_a = C.all_gather(a.unsqueeze(0), row, 0, async_op=True) if need_b else None    # [q, m/q, k/q]
    terms_a = terms_b = None
    if need_a:                                   # dA(i, t) terms g·B(t, j)ᵀ, slot t; mine: t = i
        terms_a = g.new_empty(q, g.shape[0], b.shape[0])
        torch.mm(g, b.t(), out=terms_a[col.rank])
    if need_b:                                   # dB(t, j) terms A(i, t)ᵀ·g, slot t; mine: t = j
        terms_b = g.new_empty(q, a.shape[1], g.shape[1])
        torch.mm(a.t(), g, out=terms_b[row.rank])
    reduce_a = reduce_b = None
    if need_a:
        panels = gather_b.wait()
        for t in range(q):
            if t != col.rank:
                torch.mm(g, panels[t].t(), out=terms_a[t])
        reduce_a = C.reduce_scatter(terms_a, row, 0, async_op=True)
    if need_b:
        panels = gather_a.wait()
        for t in range(q):
            if t != row.rank:
                torch.mm(panels[t].t(), g, out=terms_b[t])
        reduce_b = C.reduce_scatter(terms_b, col, 0, async_op=True)
    return (reduce_a.wait()[0] if need_a else None, reduce_b.wait()[0] if need_b else None)


def _abt_backward(g, a, b, row, col, need_a: bool, need_b: bool, overlap: bool):
    """(dA, dB) of C = A·Bᵀ: dA = g·B (ab), dB = gᵀ·A (atb with (g, A))."""
    return (_ab(g, b, row, col, overlap) if need_a else None, _atb(g, a, row, col, overlap) if need_b else None)


def _atb_backward(g, a, b, row, col, need_a: bool, need_b: bool, overlap: bool):
    """(dA, dB) of C = Aᵀ·B: dA = B·gᵀ (abt with (B, g)), dB = A·g (ab)."""
    return (_abt(b, g, row, col, overlap) if need_a else None, _ab(a, g, row, col, overlap) if need_b else None)


# product name → (forward, backward); every backward is made of the three products (module docstring)
_PRODUCTS = {"ab": (_ab, _ab_backward), "abt": (_abt, _abt_backward), "atb": (_atb, _atb_backward)}


class _Summa(torch.autograd.Function):
    """The SUMMA product ``kind`` (a key of ``_PRODUCTS``) of blocks ``a`` and ``b``."""

    @staticmethod
    def forward(ctx, a, b, row, col, overlap, kind):
        ctx.save_for_backward(a, b)
        ctx.axes, ctx.overlap, ctx.kind = (row, col), overlap, kind
        return _PRODUCTS[kind][0](a, b, row, col, overlap)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        da, db = _PRODUCTS[ctx.kind][1](g, a, b, *ctx.axes, need_a, need_b, ctx.overlap)
        return da, db, None, None, None, None


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
        da, db = _ab_backward(g, a, torch.cat(parts, 1), row, col, ctx.needs_input_grad[0], True, ctx.overlap)
        return (da, None, None, None, *db.split([p.shape[1] for p in parts], 1))


def summa_ab_parts(a: torch.Tensor, parts, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·[B₀ | B₁ | …] from A(i, j) and the parts' blocks B_k(i, j) [k/q, n_k/q]
    → [m/q, Σ n_k/q]: the communication of one product of width Σ n_k, without keeping the
    joined weight between forward and backward."""
    row, col = _grid(mesh)
    a, *parts = _autocast_operands(a, *parts)
    return _SummaABParts.apply(a, row, col, overlap, *parts)


def _autocast_operands(a: torch.Tensor, *others: torch.Tensor):
    """Inside ``torch.autocast``, cast the operands to the autocast dtype, as autocast does
    for a matmul: a bf16 activation then meets a bf16 copy of an fp32 weight (the in-place
    ``addmm_`` of :func:`_ab` is not autocast and would reject mixed dtypes), the panels
    travel in the low precision, and the casts carry the gradients back to fp32."""
    dev = a.device.type
    if not torch.is_autocast_enabled(dev):
        return (a, *others)
    dtype = torch.get_autocast_dtype(dev)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (a, *others))


def _grid(mesh):
    if getattr(mesh, "q", None) is None:
        from ...errors import LayoutError

        raise LayoutError(f"SUMMA needs a 2D mesh, got tensor_mode={mesh.tensor_mode!r}. "
                          f"Fix: build_mesh(..., tensor=q*q, tensor_mode='2d').")
    return mesh.row, mesh.col


def _product(kind: str, a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool) -> torch.Tensor:
    row, col = _grid(mesh)
    a, b = _autocast_operands(a, b)
    return _Summa.apply(a, b, row, col, overlap, kind)


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·B from blocks A(i, j) [m/q, k/q] and B(i, j) [k/q, n/q]; → [m/q, n/q]."""
    return _product("ab", a, b, mesh, overlap)


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of A·Bᵀ from A(i, j) [m/q, k/q] and B(i, j) [n/q, k/q]; → [m/q, n/q]."""
    return _product("abt", a, b, mesh, overlap)


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh, overlap: bool = True) -> torch.Tensor:
    """Block (i, j) of Aᵀ·B from A(i, j) [m/q, k/q] and B(i, j) [m/q, n/q]; → [k/q, n/q]."""
    return _product("atb", a, b, mesh, overlap)
