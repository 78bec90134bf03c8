"""All-to-all context attention: sequence shards traded for head shards around attention.

Before attention each of the C context ranks holds all H heads of its 2c tokens (chunks i and
2C − 1 − i, :mod:`gridshard.context.sequence_split`). One all-to-all per tensor sends head group
g (H/C heads) of those tokens to rank g, so rank g then holds H/C heads of the whole sequence of
S = 2c·C tokens; the tokens are put back in sequence order, causal attention runs on the whole
sequence for those heads (any kernel: here ``F.scaled_dot_product_attention``), and one more
all-to-all returns each rank's tokens with all heads. Queries need H divisible by C, keys and
values H_kv divisible by C (each rank then attends with H/C query heads over H_kv/C k/v heads,
the same grouping as the whole model) or dividing C: then each k/v head is repeated C/H_kv times
before the trade (:func:`gridshard.job_layout.traded_kv_heads`), so rank g gets k/v head
g·H_kv/C — the one its query heads g·H/C … (g+1)·H/C − 1 use — and the repeat's backward sums the
copies' gradients. The k/v trades then carry C heads instead of H_kv.

The backward of an all-to-all is the inverse all-to-all, so the layer moves, per rank, in each
direction: forward q, k, v in and the output back (4 calls), backward the same four in reverse.
Payload per call = the rank's whole local tensor b·h·2c·d·bytes (the ledger's ``all_to_all``
entries; (C − 1)/C of it leaves the rank).

**Document masks** (``documents``, int [b, S]: the ids of the whole sequence, which every context
rank holds, :mod:`gridshard.nn.documents`): after the trade a rank has its heads over the whole
sequence in order, so the document-causal mask is ``attention_mask(docs, docs)`` [b, 1, S, S]
(broadcast over heads), given to SDPA as ``attn_mask`` instead of ``is_causal``. The ids are never
sent: the trades and their bytes are the same as without them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.ledger import record
from ..job_layout import ContextMode, traded_kv_heads
from ..nn.documents import attention_mask, check_documents
from .sequence_split import shard_sequence, unshard_sequence


def _exchange(x: torch.Tensor, axis, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Cut ``x`` into C blocks along ``split_dim``, send block g to rank g, and concatenate the
    blocks received (in rank order) along ``cat_dim``."""
    C = axis.size
    send = torch.stack(x.chunk(C, dim=split_dim)).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", axis, x.numel() * x.element_size())
    dist.all_to_all_single(recv, send, group=axis.group)
    return torch.cat(recv.unbind(0), dim=cat_dim)


class _Trade(torch.autograd.Function):
    """``to_sequence``: [b, h, 2c, d] (all heads, local tokens) → [b, h/C, S, d] (a head group, all
    tokens in order); otherwise the inverse. The gradient of either is the other."""

    @staticmethod
    def forward(ctx, x, axis, to_sequence: bool):
        ctx.axis, ctx.to_sequence = axis, to_sequence
        return (_to_sequence if to_sequence else _to_heads)(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return (_to_heads if ctx.to_sequence else _to_sequence)(grad, ctx.axis), None, None


def _to_sequence(x, axis):
    y = _exchange(x, axis, split_dim=1, cat_dim=2)            # rank-ordered chunks [r0: i, 2C−1−i | r1 …]
    return unshard_sequence(list(y.chunk(axis.size, dim=2)), dim=2)


def _to_heads(x, axis):
    rank_ordered = torch.cat([shard_sequence(x, axis.size, r, dim=2) for r in range(axis.size)], dim=2)
    return _exchange(rank_ordered, axis, split_dim=2, cat_dim=1)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis, scale=None,
                         documents=None) -> torch.Tensor:
    """Causal attention over a sequence split on ``axis`` by trading sequence for heads (module doc).

    ``q`` [b, H, 2c, d], ``k``/``v`` [b, H_kv, 2c, d] as for
    :func:`gridshard.context.ring_attention.ring_attention`; returns this rank's [b, H, 2c, d].
    ``documents``: int [b, S] ids of the whole sequence (S = 2c·C): document-causal attention."""
    C, kv = axis.size, k.shape[1]
    ContextMode.ALL_TO_ALL.check_heads(q.shape[1], kv, C)      # LayoutError naming the heads and a fix
    mask = None
    if documents is not None:
        check_documents(documents, (q.shape[0], q.shape[2] * C))
        documents = documents.to(q.device)
        mask = attention_mask(documents, documents)
    if C > 1:                                                  # C = 1: plain causal attention
        repeat = traded_kv_heads(kv, C) // kv
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = (_Trade.apply(t, axis, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return _Trade.apply(out, axis, False) if C > 1 else out
