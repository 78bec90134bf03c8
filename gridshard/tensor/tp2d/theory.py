"""SUMMA 2D tensor parallelism on a q×q grid (T = q²): bytes moved and stored per rank.

Notation: grid side q, N = b·s tokens, e = bytes per element, a linear layer
Y[N, out] = X[N, in]·W[in, out]. Rank (i, j) holds X(i, j) [N/q, in/q],
W(i, j) [in/q, out/q], Y(i, j) [N/q, out/q]. ``row`` = the q ranks of my grid row,
``col`` = the q ranks of my grid column. Payload bytes follow the ledger convention
(broadcast, reduce, all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the unscattered input); volumes are returned per axis as
``{"row": CommVolume, "col": CommVolume}`` so tests can compare with the ledger's
(op, axis) entries exactly. With q = 1 nothing is communicated.

One SUMMA product, per rank (:mod:`gridshard.tensor.tp2d.summa`):

====================  =====================================  ======================================
product               row                                    col
====================  =====================================  ======================================
C = A·B   [m,k]·[k,n]  q broadcasts of m·k/q²·e (A panels)    q broadcasts of k·n/q²·e (B panels)
C = A·Bᵀ  [m,k]·[n,k]ᵀ 1 reduce-scatter of q·m·n/q²·e         1 all-gather of q·n·k/q²·e (B panels)
                       (the q C terms)
C = Aᵀ·B  [m,k]ᵀ·[m,n] 1 all-gather of q·m·k/q²·e (A panels)  1 reduce-scatter of q·k·n/q²·e
                                                              (the q C terms)
====================  =====================================  ======================================

(A·Bᵀ and Aᵀ·B were q broadcasts + q reduces of the same blocks: the same payload and the
same ring wire bytes, (q − 1)/q of the payload, in 2 calls instead of 2q.)

Linear2D forward + backward = A·B (forward) + dX = dY·Wᵀ (A·Bᵀ with m=N, k=out,
n=in) + dW = Xᵀ·dY (Aᵀ·B with m=N, k=in, n=out):

* row: q broadcasts of N·in/q²·e (X panels, forward), one all-gather of N·in/q·e (X
  panels for dW) and one reduce-scatter of N·in/q·e (dX terms) → payload 3·N·in/q·e;
* col: q broadcasts of in·out/q²·e (W panels, forward), one all-gather of in·out/q·e (W
  panels for dX) and one reduce-scatter of in·out/q·e (dW terms) → payload 3·in·out/q·e;
* bias: one all-gather (out/q·e) forward unless a gathered copy is kept (the first forward
  of a :class:`gridshard.comm.grid_ops.GatheredVectors` window gathers, later ones in it
  do not: ``vector_gathers=0``; the trainer opens one window per optimizer step), one
  reduce-scatter (out/q·e) backward, col.

Rounds: 2q + 4 collective calls (+1 or 2 with bias); of the 2q broadcasts a rank sources
2 and receives 2(q − 1). Ring wire bytes are (q − 1)/q of the payload:
3(q − 1)/q²·(N·in + in·out)·e, i.e. the seed table's bandwidth 6(q − 1)/q in units of the
per-rank blocks (N·in + in·out)/(2q)·e.

Per rank: parameters (in·out + out)/q² elements (exactly 1/q² of the layer); saved
for backward the input block N·in/q² elements (1/q² of a single device's).

Decoder block: q|k|v share one input and are computed as one product of width
h + 2·K·d (H heads, K kv heads, d = h/H; K = H by default, i.e. 3h), gate|up as one of
width 2f, then o (h→h) and down (f→h): four Linear2D volumes and two RMSNorm2D. With
grouped-query attention (K < H, q | K) only the q|k|v width changes; parameters per
rank (2h² + 2·K·d·h + 3hf + 2h)/q².
"""
from __future__ import annotations

from ...theory import CommVolume
from ...theory.vocab import padded_vocab_size as padded_vocab

AXES = ("row", "col")


def _zero(q: int) -> dict:
    return {a: CommVolume(q) for a in AXES}


def combine(*vols: dict) -> dict:
    """Sum per-axis volumes."""
    out = _zero(next(iter(vols[0].values())).group_size)
    for v in vols:
        for a in AXES:
            out[a] = out[a] + v[a]
    return out


def total(vol: dict) -> CommVolume:
    """Both axes in one :class:`CommVolume` (both groups have q ranks)."""
    return vol["row"] + vol["col"]


def rounds(vol: dict) -> int:
    """Number of collective calls per rank."""
    return sum(sum(v.calls.values()) for v in vol.values())


def summa_ab_comm(m: int, k: int, n: int, q: int, bytes_per_elem: int = 4) -> dict:
    """C[m, n] = A[m, k]·B[k, n]: q row broadcasts of A panels, q column broadcasts of B panels."""
    v = _zero(q)
    v["row"].add("broadcast", m * k // (q * q) * bytes_per_elem, q)
    v["col"].add("broadcast", k * n // (q * q) * bytes_per_elem, q)
    return v


def summa_abt_comm(m: int, k: int, n: int, q: int, bytes_per_elem: int = 4) -> dict:
    """C[m, n] = A[m, k]·B[n, k]ᵀ: one column all-gather of the q B panels (q·n·k/q²·e), one
    row reduce-scatter of the q C terms (q·m·n/q²·e)."""
    v = _zero(q)
    v["col"].add("all_gather", q * (n * k // (q * q)) * bytes_per_elem)
    v["row"].add("reduce_scatter", q * (m * n // (q * q)) * bytes_per_elem)
    return v


def summa_atb_comm(m: int, k: int, n: int, q: int, bytes_per_elem: int = 4) -> dict:
    """C[k, n] = A[m, k]ᵀ·B[m, n]: one row all-gather of the q A panels (q·m·k/q²·e), one
    column reduce-scatter of the q C terms (q·k·n/q²·e)."""
    v = _zero(q)
    v["row"].add("all_gather", q * (m * k // (q * q)) * bytes_per_elem)
    v["col"].add("reduce_scatter", q * (k * n // (q * q)) * bytes_per_elem)
    return v


def linear2d_comm(tokens: int, in_features: int, out_features: int, q: int, bytes_per_elem: int = 4,
                  bias: bool = False, input_grad: bool = True, vector_gathers: int = 1) -> dict:
    """One Linear2D forward + backward over ``tokens`` = b·s tokens (module docstring).
    ``input_grad=False`` drops the dX product (a layer whose input needs no gradient).
    ``vector_gathers``: bias all-gathers in this pass (1 without a window or in its first
    forward; 0 for a later forward in the same window, whose gathered block is kept)."""
    e = bytes_per_elem
    parts = [summa_ab_comm(tokens, in_features, out_features, q, e),
             summa_atb_comm(tokens, in_features, out_features, q, e)]
    if input_grad:
        parts.append(summa_abt_comm(tokens, out_features, in_features, q, e))
    vol = combine(*parts)
    if bias:
        vol["col"].add("all_gather", out_features // q * e, vector_gathers)
        vol["col"].add("reduce_scatter", out_features // q * e)
    return vol


def rmsnorm2d_comm(tokens: int, hidden: int, q: int, bytes_per_elem: int = 4, vector_gathers: int = 1) -> dict:
    """RMSNorm2D forward + backward: weight all-gather (h/q·e) forward when stale
    (``vector_gathers``, see :func:`linear2d_comm`) and reduce-scatter backward on the
    column; Σx² forward and Σ(g·w·x) backward all-reduced on the row ([N/q, 1] each, fp32
    whatever e: the norm computes in fp32, :mod:`gridshard.tensor.tp2d.norm`)."""
    e = bytes_per_elem
    v = _zero(q)
    v["col"].add("all_gather", hidden // q * e, vector_gathers).add("reduce_scatter", hidden // q * e)
    v["row"].add("all_reduce", tokens // q * 4, 2)
    return v


def layernorm2d_comm(tokens: int, hidden: int, q: int, bytes_per_elem: int = 4, vector_gathers: int = 1) -> dict:
    """LayerNorm2D forward + backward: weight and bias all-gathered (h/q·e each) forward when
    stale (``vector_gathers``) and reduce-scattered backward on the column; Σx and Σ(x−μ)²
    forward ([N/q, 1] each) and (Σ g·w, Σ g·w·x̂) backward ([N/q, 2]) all-reduced on the row, fp32
    whatever e (:mod:`gridshard.tensor.tp2d.norm`)."""
    e = bytes_per_elem
    v = _zero(q)
    v["col"].add("all_gather", hidden // q * e, 2 * vector_gathers).add("reduce_scatter", hidden // q * e, 2)
    v["row"].add("all_reduce", tokens // q * 4, 2).add("all_reduce", 2 * tokens // q * 4)
    return v


def _qkv_width(hidden: int, heads, kv_heads) -> int:
    """h + 2·K·d (d = h/H); 3h for multi-head attention (``heads``/``kv_heads`` None or equal)."""
    if heads is None or kv_heads is None or kv_heads == heads:
        return 3 * hidden
    assert heads % kv_heads == 0 and hidden % heads == 0, "kv_heads must divide heads, heads must divide hidden"
    return hidden + 2 * kv_heads * (hidden // heads)


def block2d_comm(batch: int, seq: int, hidden: int, ffn: int, q: int, bytes_per_elem: int = 4,
                 heads: int | None = None, kv_heads: int | None = None) -> dict:
    """One decoder block forward + backward: linears h→3h (q|k|v; h→h+2·K·d with grouped-query
    attention), h→h, h→2f (gate|up), f→h and two RMSNorms."""
    n, e = batch * seq, bytes_per_elem
    norm = rmsnorm2d_comm(n, hidden, q, e)
    qkv = _qkv_width(hidden, heads, kv_heads)
    return combine(norm, norm, linear2d_comm(n, hidden, qkv, q, e), linear2d_comm(n, hidden, hidden, q, e),
                   linear2d_comm(n, hidden, 2 * ffn, q, e), linear2d_comm(n, ffn, hidden, q, e))


def embedding2d_comm(batch: int, seq: int, hidden: int, q: int, bytes_per_elem: int = 4,
                     token_bytes: int = 8) -> dict:
    """VocabParallelEmbedding2D forward + backward, all on the column: token all-gather
    (b·s·8 bytes), output reduce-scatter and gradient all-gather of b·s·h/q·e each."""
    v = _zero(q)
    a = batch * seq * hidden // q * bytes_per_elem
    v["col"].add("all_gather", batch * seq * token_bytes).add("reduce_scatter", a).add("all_gather", a)
    return v


def tied_head2d_comm(tokens: int, hidden: int, vocab: int, q: int, bytes_per_elem: int = 4) -> dict:
    """Tied head logits = X·Eᵀ (A·Bᵀ, m=N, k=h, n=V_pad) forward; backward dX = dZ·E
    (A·B, m=N, k=V_pad, n=h) and dE = dZᵀ·X (Aᵀ·B, m=N, k=V_pad, n=h)."""
    vp, e = padded_vocab(vocab, q), bytes_per_elem
    return combine(summa_abt_comm(tokens, hidden, vp, q, e), summa_ab_comm(tokens, vp, hidden, q, e),
                   summa_atb_comm(tokens, vp, hidden, q, e))


def cross_entropy2d_comm(tokens: int, q: int) -> dict:
    """2D cross-entropy forward (fp32): row all-reduce(max) of N/q·4 bytes, row all-reduce
    of [2, N/q]·4 bytes, column all-reduce of (2 + 2q)·8 bytes (float64: loss sum, valid
    count, and the q batch blocks' target-range verdicts, :mod:`gridshard.nn.id_range`)."""
    v = _zero(q)
    v["row"].add("all_reduce", tokens // q * 4).add("all_reduce", 2 * tokens // q * 4)
    v["col"].add("all_reduce", (2 + 2 * q) * 8)
    return v


def transformer2d_comm(layers: int, batch: int, seq: int, hidden: int, ffn: int, vocab: int, q: int,
                       tied: bool = False, bytes_per_elem: int = 4, heads: int | None = None,
                       kv_heads: int | None = None) -> dict:
    """One training step (forward + backward + loss) of ``gridshard.models.Transformer`` laid
    out on a q×q grid (``heads``/``kv_heads``: grouped-query attention, see :func:`block2d_comm`)."""
    n, e = batch * seq, bytes_per_elem
    parts = [embedding2d_comm(batch, seq, hidden, q, e)]
    parts += [block2d_comm(batch, seq, hidden, ffn, q, e, heads, kv_heads) for _ in range(layers)]
    parts.append(rmsnorm2d_comm(n, hidden, q, e))
    parts.append(tied_head2d_comm(n, hidden, vocab, q, e) if tied
                 else linear2d_comm(n, hidden, padded_vocab(vocab, q), q, e))
    parts.append(cross_entropy2d_comm(n, q))
    return combine(*parts)


def linear2d_param_bytes(in_features: int, out_features: int, q: int, bytes_per_elem: int = 4,
                         bias: bool = False) -> int:
    """(in·out + out)/q² elements per rank: exactly 1/q² of the layer."""
    return (in_features * out_features + (out_features if bias else 0)) // (q * q) * bytes_per_elem


def block2d_param_bytes(hidden: int, ffn: int, q: int, bytes_per_elem: int = 4, heads: int | None = None,
                        kv_heads: int | None = None) -> int:
    """(4h² + 3hf + 2h)/q² elements per rank (norm weights are q²-sharded too); with
    grouped-query attention (h + 2·K·d)·h replaces 3h² (module docstring)."""
    qkv = _qkv_width(hidden, heads, kv_heads)
    return ((qkv + hidden) * hidden + 3 * hidden * ffn + 2 * hidden) // (q * q) * bytes_per_elem


def transformer2d_param_bytes(layers: int, hidden: int, ffn: int, vocab: int, q: int, tied: bool = False,
                              bytes_per_elem: int = 4, heads: int | None = None, kv_heads: int | None = None) -> int:
    """Whole model per rank: blocks, final norm, embedding and head V_pad·h/q² each (one if tied)."""
    tables = (1 if tied else 2) * padded_vocab(vocab, q) * hidden // (q * q)
    return layers * block2d_param_bytes(hidden, ffn, q, bytes_per_elem, heads, kv_heads) + \
        (tables + hidden // (q * q)) * bytes_per_elem


def linear2d_saved_activation_bytes(tokens: int, in_features: int, q: int, bytes_per_elem: int = 4) -> int:
    """Saved for backward per rank: the input block N·in/q² elements (1/q² of one device)."""
    return tokens * in_features // (q * q) * bytes_per_elem


__all__ = ["summa_ab_comm", "summa_abt_comm", "summa_atb_comm", "linear2d_comm", "rmsnorm2d_comm", "layernorm2d_comm",
           "block2d_comm", "embedding2d_comm", "tied_head2d_comm", "cross_entropy2d_comm", "transformer2d_comm",
           "linear2d_param_bytes", "block2d_param_bytes", "transformer2d_param_bytes",
           "linear2d_saved_activation_bytes", "combine", "total", "rounds"]
