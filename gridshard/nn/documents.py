"""Document masks of packed windows: which token may attend to which, and rotary positions.

A packed window holds several documents one after another. Its **document ids** ``docs`` [b, S]
(int64) number them per row, non-decreasing along the sequence: token t belongs to document
``docs[r, t]``, and a document's tokens are contiguous. The window's attention is then
*document-causal*: query i attends to key j iff

    docs[i] = docs[j]  and  j ≤ i,

so no token attends across a document boundary, and the rotary position of token t restarts at
each document's first token:

    pos[t] = t − first(t),   first(t) = min{ u : docs[u] = docs[t] }.

Padding (what ``data.packing: first_fit`` leaves at a window's end) is a document of its own whose
targets are ignored, so every query row keeps at least its own key (its diagonal) and no softmax
row is empty.

The ids always cover the **whole sequence** of a row: under context parallelism each context rank
holds the ids of every chunk, so the ring and the all-to-all attention read the masks of the blocks
they compute without sending a byte of them (:mod:`gridshard.context`). They are cut by batch
blocks exactly as the tokens are (2D/2.5D/3D, :meth:`gridshard.parallel.model_context.ParallelContext.shard_documents`).

Because ids are non-decreasing, two token ranges can share a document only at their ends: keys
[k0, k1) all before queries [q0, q1) (k1 ≤ q0) meet iff ``docs[k1 − 1] = docs[q0]``
(:func:`blocks_meet`), which the ring uses to skip blocks a mask empties.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def check_documents(docs: torch.Tensor, tokens_shape) -> None:
    """ValueError unless ``docs`` is an integer [b, S] tensor of ``tokens_shape`` whose rows never decrease."""
    if docs.dtype.is_floating_point or tuple(docs.shape) != tuple(tokens_shape):
        raise ValueError(f"document ids of shape {tuple(docs.shape)} and dtype {docs.dtype} do not match tokens of "
                         f"shape {tuple(tokens_shape)}. Fix: give one integer id per token "
                         f"(gridshard.data.packing.document_ids).")
    if docs.shape[-1] > 1 and bool((docs[..., 1:] < docs[..., :-1]).any()):
        raise ValueError("document ids decrease along a row: a document's tokens must be contiguous and numbered "
                         "in order. Fix: number documents 0, 1, 2, … along each window.")


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """[b, S] int64 rotary position of each token: its index within its document (module docstring)."""
    S = docs.shape[-1]
    t = torch.arange(S, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=-1).values
    return t - first


def attention_mask(doc_q: torch.Tensor, doc_k: torch.Tensor, pos_q=None, pos_k=None) -> torch.Tensor:
    """Boolean [b, 1, n_q, n_k] mask (True: attend) of queries with ids ``doc_q`` [b, n_q] over keys
    ``doc_k`` [b, n_k]: same document and, given the tokens' sequence indices ``pos_q`` [n_q] and
    ``pos_k`` [n_k], key index ≤ query index (without them: the keys are the queries, causal by order)."""
    same = doc_q[:, :, None] == doc_k[:, None, :]
    if pos_q is None:
        n = doc_q.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=doc_q.device).tril()
    else:
        causal = pos_k[None, :] <= pos_q[:, None]
    return (same & causal).unsqueeze(1)


def blocks_meet(docs: torch.Tensor, keys: tuple, queries: tuple) -> bool:
    """Whether any query in [q0, q1) may attend to any key in [k0, k1) of any row, for key ranges
    entirely before the queries (k1 ≤ q0) or equal to them: their ids must meet at the ends
    (module docstring). ``keys`` = (k0, k1), ``queries`` = (q0, q1), sequence indices."""
    (k0, k1), (q0, q1) = keys, queries
    if (k0, k1) == (q0, q1):
        return True
    if k1 > q0:
        raise ValueError(f"blocks_meet: keys [{k0}, {k1}) are not all before queries [{q0}, {q1}).")
    return bool((docs[:, k1 - 1] == docs[:, q0]).any())


class DocumentMask(NamedTuple):
    """The third input of every decoder layer on packed windows: ``ids`` [b, S] of the whole
    sequences, and ``mask`` [b, 1, s, s] (additive: 0 attend, −∞ not) for attention on this rank's whole sequences
    — None under context parallelism, whose attention reads the ids (:mod:`gridshard.context`)."""

    ids: torch.Tensor
    mask: Optional[torch.Tensor]


def document_inputs(docs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, local=None) -> tuple:
    """(cos, sin, :class:`DocumentMask`) of packed windows: the rotary tables ``cos``, ``sin`` [≥ S, d]
    read at each token's position within its document ([b, s, d]). ``local``: the sequence indices of
    this rank's tokens under context parallelism
    (:func:`gridshard.context.sequence_split.global_positions`), the mask then left to the context
    attention; None: the whole sequence.

    The mask is additive (0 where a query attends, −∞ elsewhere) in the tables' dtype, the
    activations': SDPA converts a boolean mask to that form on every call and keeps each layer's
    copy for backward, so one additive mask, built once per micro-batch and shared by every layer,
    is what they keep instead: m·s²·e bytes per micro-batch in flight (e the activations' element
    bytes), beside the per-token tables' 2·m·s·d·e (``gridshard.theory.memory.activations``)."""
    positions = document_positions(docs)
    if local is not None:
        positions = positions[:, local]
    mask = None
    if local is None:
        mask = torch.zeros(attention_mask(docs, docs).shape, dtype=cos.dtype, device=docs.device)
        mask.masked_fill_(~attention_mask(docs, docs), float("-inf"))
    return cos[positions], sin[positions], DocumentMask(docs, mask)


def chunk_blocks(docs: torch.Tensor, n_chunks: int) -> tuple:
    """``(meets, whole)``: two n × n nested lists of bools over (key chunk k, query chunk q) of each row
    cut into ``n_chunks`` equal chunks of c tokens, read from the ids at the chunks' ends in one transfer:

    * ``meets[k][q]``: some query of chunk q attends some key of chunk k in some row —
      k = q always, k < q iff docs[(k + 1)·c − 1] = docs[q·c] in some row (:func:`blocks_meet`);
    * ``whole[k][q]``: the block's mask is the plain one in every row (all True for k < q, the causal
      triangle for k = q): keys and queries lie in one document, docs[k·c] = docs[(q + 1)·c − 1].

    Both are False for k > q (keys after the queries)."""
    S = docs.shape[-1]
    if S % n_chunks:
        raise ValueError(f"a sequence of {S} tokens does not split into {n_chunks} equal chunks. Fix: use a "
                         f"sequence length that is a multiple of {n_chunks}.")
    c = S // n_chunks
    first, last = docs[:, ::c], docs[:, c - 1::c]                        # [b, n] ids at each chunk's ends
    meets = (last[:, :, None] == first[:, None, :]).any(0).triu(1) | torch.eye(n_chunks, dtype=torch.bool,
                                                                                 device=docs.device)
    whole = (first[:, :, None] == last[:, None, :]).all(0).triu()
    return meets.tolist(), whole.tolist()
