"""Megatron 1D tensor parallelism (± sequence parallelism): bytes moved and stored per rank.

Notation: T tensor ranks, batch b, sequence s, hidden h, MLP width f, vocabulary V
(padded V_p = ⌈V/T⌉·T), e = bytes per element of activations/parameters, and
A = b·s·h·e, the size of one full residual activation. Payload bytes follow the
ledger convention (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the unscattered input). With T = 1 nothing is communicated.

Column → row pair (one MLP, or attention's qkv → proj), forward + backward
--------------------------------------------------------------------------
* no SP: the row output is all-reduced forward (A) and the column input gradient
  is all-reduced backward (A): 2 all-reduces of A.
* SP: the column input is all-gathered along the sequence forward (A) and its
  gradient reduce-scattered backward (A); the column layer keeps only its sequence
  block for backward and all-gathers it again there for the weight gradient (A,
  Megatron's choice: :mod:`gridshard.tensor.tp1d.input_grad_overlap`); the row output is
  reduce-scattered forward (A) and its gradient all-gathered backward (A): 3
  all-gathers + 2 reduce-scatters of A. A row bias (replicated, added to the sequence
  block) needs no collective: its gradient is summed from the all-gathered output
  gradient that the reduce-scatter's backward produces anyway (an all-reduce of h·e
  before).

Ring wire bytes: no SP 2·2(T−1)/T·A; SP 5·(T−1)/T·A. Without the backward re-gather
SP would move the same volume (it splits each all-reduce into its two halves); the
re-gather adds (T−1)/T·A per column input, and in exchange the column input is kept
at A/T instead of A, like the rest of the residual stream.

Transformer block (2 pairs, 2 RMSNorms, no biases)
--------------------------------------------------
* no SP: 4 all-reduces of A (2 forward at the row outputs, 2 backward at the
  column inputs);
* SP: 6 all-gathers of A + 4 reduce-scatters of A (2 of the all-gathers re-gather the
  column inputs in backward), plus 2 all-reduces of h·e for the norm weight gradients
  (partial over the sequence blocks).

Whole model (L blocks, vocab-parallel embedding, final norm, head, loss)
-----------------------------------------------------------------------
The embedding adds one all-reduce of A forward (SP: reduce-scatter forward,
all-gather backward), the head one column input (no SP: all-reduce of its
gradient; SP: all-gather forward, reduce-scatter and the re-gather backward), the final norm (SP)
one all-reduce of h·e, and the vocab-parallel cross-entropy over N = b·s tokens
one all-reduce(max) of 4N bytes and one all-reduce(sum) of 8N bytes (fp32,
forward only).

Parameters per rank
-------------------
block: (4h² + 3hf)/T + 2h elements (qkv 3h·h/T, proj h·h/T, gate|up 2f·h/T,
down h·f/T, two replicated norm weights h); embedding and head V_p/T·h each
(one if tied); final norm h.

Grouped-query attention (optional ``heads`` H and ``kv_heads`` K < H)
---------------------------------------------------------------------
With d = h/H the k and v projections are [K·d, h] each. Their input is the shared
q|k|v input, so the all-reduce / all-gather / reduce-scatter of A above do not change.

* T ≤ K (T divides K): k and v are split like q: K·d·h/T elements each per rank,
  no extra communication.
* T > K (K divides T): each kv head is replicated on a group of T/K consecutive ranks
  (each holds the d rows of its kv head, d·h = K·d·h/K elements); the ranks of a group
  contribute partial gradients (their own query heads), summed by one all-reduce over
  the whole tensor axis of a buffer holding all K blocks (K·d·h·e) per projection:
  2 extra all-reduces of K·d·h·e per block (backward only).

Parameters per block: (2h² + 3hf)/T + 2·K·d·h/min(T, K) + 2h elements.
With K = H (the default) all of this reduces to the multi-head figures.
"""
from __future__ import annotations

from ...theory import CommVolume


def residual_bytes(batch: int, seq: int, hidden: int, bytes_per_elem: int = 4) -> int:
    """A = b·s·h·e: one full residual activation."""
    return batch * seq * hidden * bytes_per_elem


def column_row_comm(batch: int, seq: int, hidden: int, T: int, sequence_parallel: bool,
                    bytes_per_elem: int = 4, row_bias: bool = False) -> CommVolume:
    """One ColumnParallelLinear(h→n) → RowParallelLinear(n→h) pair, forward + backward
    (see the module docstring): no SP 2 all-reduces of A; SP 3 all-gathers (one re-gathers
    the column input in backward) + 2 reduce-scatters of A. ``row_bias`` (a bias on the row layer) adds nothing either way
    (under SP its gradient comes from the gathered output gradient; kept for callers)."""
    a = residual_bytes(batch, seq, hidden, bytes_per_elem)
    v = CommVolume(T)
    if sequence_parallel:
        v.add("all_gather", a, 3).add("reduce_scatter", a, 2)
    else:
        v.add("all_reduce", a, 2)
    return v


def block_recompute_comm(batch: int, seq: int, hidden: int, T: int, sequence_parallel: bool,
                         bytes_per_elem: int = 4) -> CommVolume:
    """The collectives ``train.recompute=full`` runs a second time per decoder block and
    micro-batch. The recomputation inside backward repeats the layer's forward, collectives
    included (:mod:`gridshard.parallel.recompute`), but PyTorch's non-reentrant checkpoint
    stops as soon as the last tensor backward needs is rebuilt — the MLP's down projection
    input — so the MLP's row-output collective is *not* repeated: no SP one all-reduce of A
    (attention's row output); SP two all-gathers (both column inputs) and one reduce-scatter
    (attention's row output) of A. Norm-weight and kv-gradient all-reduces are backward-only, and
    so is the SP column layers' re-gather of their saved block (it runs once per backward,
    recomputed or not: :func:`block_comm`)."""
    a = residual_bytes(batch, seq, hidden, bytes_per_elem)
    v = CommVolume(T)
    if sequence_parallel:
        return v.add("all_gather", a, 2).add("reduce_scatter", a, 1)
    return v.add("all_reduce", a, 1)


def norm_comm(hidden: int, T: int, sequence_parallel: bool, bytes_per_elem: int = 4) -> CommVolume:
    """An RMSNorm: under SP its weight gradient is all-reduced (h·e); otherwise nothing."""
    return CommVolume(T).add("all_reduce", hidden * bytes_per_elem, 1 if sequence_parallel else 0)


def _gqa(hidden: int, heads, kv_heads):
    """(K·d, K) of grouped-query attention, or None for multi-head attention (K = H)."""
    if heads is None or kv_heads is None or kv_heads == heads:
        return None
    assert heads % kv_heads == 0 and hidden % heads == 0, "kv_heads must divide heads, heads must divide hidden"
    return kv_heads * (hidden // heads), kv_heads


def block_comm(batch: int, seq: int, hidden: int, T: int, sequence_parallel: bool,
               bytes_per_elem: int = 4, heads: int | None = None, kv_heads: int | None = None,
               grad_bytes: int | None = None) -> CommVolume:
    """One decoder block forward + backward: attention and MLP pairs plus two norms; activations in
    ``bytes_per_elem``-byte elements, the weight gradients in ``grad_bytes`` (default the same).

    Grouped-query attention (``heads`` H and ``kv_heads`` K given, K < H; module
    docstring): when T > K the replicated k and v weight gradients add 2 all-reduces of
    K·d·h·e (d = h/H); when T ≤ K nothing changes."""
    g = bytes_per_elem if grad_bytes is None else grad_bytes
    pair = column_row_comm(batch, seq, hidden, T, sequence_parallel, bytes_per_elem)
    norm = norm_comm(hidden, T, sequence_parallel, g)
    v = pair + pair + norm + norm
    gqa = _gqa(hidden, heads, kv_heads)
    if gqa is not None and T > gqa[1]:
        v.add("all_reduce", gqa[0] * hidden * g, 2)
    return v


def embedding_comm(batch: int, seq: int, hidden: int, T: int, sequence_parallel: bool,
                   bytes_per_elem: int = 4) -> CommVolume:
    """VocabParallelEmbedding forward + backward: no SP one all-reduce of A (forward only);
    SP one reduce-scatter of A forward and one all-gather of A backward."""
    a = residual_bytes(batch, seq, hidden, bytes_per_elem)
    v = CommVolume(T)
    if sequence_parallel:
        return v.add("reduce_scatter", a).add("all_gather", a)
    return v.add("all_reduce", a)


def head_comm(batch: int, seq: int, hidden: int, T: int, sequence_parallel: bool,
              bytes_per_elem: int = 4) -> CommVolume:
    """Column-parallel LM head input: no SP one all-reduce of A (backward); SP one
    all-gather of A forward, and backward one reduce-scatter of A and the all-gather of A
    that re-gathers the saved sequence block for the weight gradient."""
    a = residual_bytes(batch, seq, hidden, bytes_per_elem)
    v = CommVolume(T)
    if sequence_parallel:
        return v.add("all_gather", a, 2).add("reduce_scatter", a)
    return v.add("all_reduce", a)


def cross_entropy_comm(tokens: int, T: int) -> CommVolume:
    """Vocab-parallel cross-entropy of ``tokens`` tokens: all-reduce(max) of 4N bytes and
    one all-reduce(sum) of 8N bytes (sum-exp and target logit stacked), fp32, forward."""
    return CommVolume(T).add("all_reduce", 4 * tokens).add("all_reduce", 8 * tokens)


def block_param_elems(hidden: int, ffn: int, T: int, heads: int | None = None, kv_heads: int | None = None) -> int:
    """(4h² + 3hf)/T + 2h parameters of one block on each tensor rank; with grouped-query
    attention (K < H, d = h/H) (2h² + 3hf)/T + 2·K·d·h/min(T, K) + 2h."""
    gqa = _gqa(hidden, heads, kv_heads)
    if gqa is None:
        return (4 * hidden * hidden + 3 * hidden * ffn) // T + 2 * hidden
    kv, K = gqa
    return (2 * hidden * hidden + 3 * hidden * ffn) // T + 2 * (kv * hidden // min(T, K)) + 2 * hidden


def block_param_bytes(hidden: int, ffn: int, T: int, bytes_per_elem: int = 4, heads: int | None = None,
                      kv_heads: int | None = None) -> int:
    """Bytes of one block's parameters on each tensor rank (the same with or without SP)."""
    return block_param_elems(hidden, ffn, T, heads, kv_heads) * bytes_per_elem
