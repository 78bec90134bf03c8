"""Ring attention over the context axis: causal attention of a sequence split over C ranks.

Each context rank holds 2c query, key and value tokens (chunks i and 2C − 1 − i of the sequence,
:mod:`gridshard.context.sequence_split`). The key/value blocks travel around the ring: at step
j = 0 … C − 1 rank r holds the keys and values of rank src = (r − j) mod C, sends them on to
r + 1 and receives the next ones from r − 1 while it computes on the block in hand (asynchronous
send/receive). Only the k/v heads travel: with grouped-query attention (H query heads, H_kv
k/v heads) a block is 2·b·H_kv·2c·d elements, H / H_kv times less than the queries would be.

**Which blocks are computed.** Query chunk a and key chunk b (global chunk indices) give a full
block when b < a, a causal (lower-triangular) block when b = a, and nothing when b > a. With the
load-balanced split every step j > 0 computes exactly two of the four chunk pairs (half the work of
a full 2c × 2c block), and step 0 two causal diagonal blocks plus one full block; every rank does
the same work.

**The log-sum-exp merge.** A block gives, for each query row, the partial output
O_b = softmax(s_b) · V_b and its log-sum-exp ℓ_b = log Σ_k exp(s_b,k) (scores s = q·kᵀ·scale).
Two partials over disjoint key sets combine exactly into the attention over their union:

    ℓ = log(exp ℓ_1 + exp ℓ_2)            (``torch.logaddexp``)
    O = exp(ℓ_1 − ℓ) · O_1 + exp(ℓ_2 − ℓ) · O_2

so after the ring every row holds softmax over all its allowed keys, exactly.

**Backward** (the flash-attention gradient per block, with the saved final O and ℓ):
with D = rowsum(dO ∘ O), P = exp(s − ℓ), dV_b = Pᵀ·dO, dP = dO·V_bᵀ, dS = P ∘ (dP − D),
dQ += dS·K_b·scale and dK_b = dSᵀ·Q·scale. The k/v blocks ring again; their gradients (fp32
accumulators) travel with them and one last shift takes each home: C − 1 k/v sends and C gradient
sends per rank.

Communication per rank and layer (:func:`gridshard.theory.context.ring_attention_volume`): forward
C − 1 sends of one k/v block, backward C − 1 k/v sends and C sends of the fp32 k/v gradient.

Why hand-written: PyTorch's ring attention (``torch.distributed.tensor.experimental``) is a
private, experimental API that patches ``scaled_dot_product_attention`` process-wide and has no
CPU kernel path; this one is a plain autograd function over a gridshard axis, recorded in the
ledger, and the block product is exact fp32 math (a fused kernel that returns the log-sum-exp can
replace :func:`_block_forward` on GPUs without changing the ring).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm.ledger import record
from .sequence_split import chunk_indices

FULL, CAUSAL = "full", "causal"


def _relation(q_chunk: int, k_chunk: int) -> Optional[str]:
    """How query chunk ``q_chunk`` sees key chunk ``k_chunk`` under the causal mask."""
    if k_chunk < q_chunk:
        return FULL
    return CAUSAL if k_chunk == q_chunk else None


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """k/v heads repeated for grouped-query attention: head h reads k/v head h // groups."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _scores(q, k, scale, how):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if how == CAUSAL:
        m = s.shape[-1]
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, how):
    """Partial output and log-sum-exp of one block (fp32)."""
    s = _scores(q, k, scale, how)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


class _Ring:
    """Asynchronous shift of one tensor to the next context rank (receive from the previous)."""

    def __init__(self, axis):
        self.axis = axis
        n, r = axis.size, axis.rank
        self.to, self.frm = axis.global_rank((r + 1) % n), axis.global_rank((r - 1) % n)

    def start(self, t: torch.Tensor, tag: int = 0):
        """Send ``t`` on and receive its successor; ``tag`` keeps the k/v and gradient rings apart."""
        t = t.contiguous()
        out = torch.empty_like(t)
        record("send", self.axis, t.numel() * t.element_size(), group_size=2)
        ops = [dist.P2POp(dist.isend, t, self.to, group=self.axis.group, tag=tag),
               dist.P2POp(dist.irecv, out, self.frm, group=self.axis.group, tag=tag)]
        works = dist.batch_isend_irecv(ops)
        return out, works

    @staticmethod
    def wait(handle):
        out, works = handle
        for w in works:
            w.wait()
        return out


def _pairs(C: int, rank: int, src: int) -> list:
    """(local query chunk, local key chunk, relation) for the blocks computed at source ``src``."""
    out = []
    for qi, qc in enumerate(chunk_indices(C, rank)):
        for ki, kc in enumerate(chunk_indices(C, src)):
            how = _relation(qc, kc)
            if how is not None:
                out.append((qi, ki, how))
    return out


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's 2c queries against all keys of the sequence (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, scale):
        C, r = axis.size, axis.rank
        groups = q.shape[1] // k.shape[1]
        qf = q.float().chunk(2, dim=2)
        kv = torch.stack([k, v])
        out = [torch.zeros_like(x) for x in qf]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for x in qf]
        ring = _Ring(axis) if C > 1 else None
        for j in range(C):
            pending = ring.start(kv) if j < C - 1 else None
            src = (r - j) % C
            ks, vs = (_expand(t.float(), groups).chunk(2, dim=2) for t in kv)
            for qi, ki, how in _pairs(C, r, src):
                o_b, l_b = _block_forward(qf[qi], ks[ki], vs[ki], scale, how)
                new = torch.logaddexp(lse[qi], l_b)
                out[qi] = out[qi] * torch.exp(lse[qi] - new).unsqueeze(-1) + o_b * torch.exp(l_b - new).unsqueeze(-1)
                lse[qi] = new
            if pending is not None:
                kv = ring.wait(pending)
        o, l = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, o, l)
        ctx.axis, ctx.scale = axis, scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        C, r = axis.size, axis.rank
        groups = q.shape[1] // k.shape[1]
        dO = grad_out.float()
        delta = (dO * o).sum(-1)
        qf, dOs = q.float().chunk(2, dim=2), dO.chunk(2, dim=2)
        lses, deltas = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        dq = [torch.zeros_like(x) for x in qf]
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        ring = _Ring(axis) if C > 1 else None
        for j in range(C):
            pending = ring.start(kv) if j < C - 1 else None
            src = (r - j) % C
            ks, vs = (_expand(t.float(), groups).chunk(2, dim=2) for t in kv)
            dks = [torch.zeros_like(x) for x in ks]
            dvs = [torch.zeros_like(x) for x in vs]
            for qi, ki, how in _pairs(C, r, src):
                p = torch.exp(_scores(qf[qi], ks[ki], scale, how) - lses[qi].unsqueeze(-1))
                dvs[ki] += torch.matmul(p.transpose(-1, -2), dOs[qi])
                ds = p * (torch.matmul(dOs[qi], vs[ki].transpose(-1, -2)) - deltas[qi].unsqueeze(-1))
                dq[qi] += torch.matmul(ds, ks[ki]) * scale
                dks[ki] += torch.matmul(ds.transpose(-1, -2), qf[qi]) * scale
            dkv += torch.stack([_fold(torch.cat(dks, dim=2), groups), _fold(torch.cat(dvs, dim=2), groups)])
            if ring is not None:
                dkv = ring.wait(ring.start(dkv, tag=1))       # the gradients travel with their block
            if pending is not None:
                kv = ring.wait(pending)
        dq = torch.cat(dq, dim=2).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: the query heads' k/v gradients summed onto their k/v head."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // groups, groups, n, d).sum(2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis, scale: Optional[float] = None):
    """Causal attention over a sequence split on ``axis`` (the context axis, C ranks).

    ``q`` [b, H, 2c, d], ``k``/``v`` [b, H_kv, 2c, d]: this rank's chunks i and 2C − 1 − i
    (:func:`gridshard.context.sequence_split.shard_sequence`), H divisible by H_kv. Returns this
    rank's [b, H, 2c, d] rows of softmax(q·kᵀ·scale + causal mask)·v over the whole sequence;
    ``scale`` defaults to 1/√d. C = 1 is plain causal attention (no communication)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} k/v heads. Fix: use a "
                         f"number of k/v heads that divides the number of query heads.")
    if q.shape[2] % 2:
        raise ValueError(f"a rank's local sequence of {q.shape[2]} tokens is not two equal chunks. Fix: split "
                         f"the sequence with gridshard.context.sequence_split.shard_sequence.")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, axis, scale)
