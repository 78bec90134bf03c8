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

**The block product** is a fused attention kernel that returns the log-sum-exp
(:func:`gridshard.context.blocks.block_kernel`: PyTorch's flash-attention op on the CPU, flash or
memory-efficient attention on CUDA): it tiles the scores, so no c × c score matrix is ever held.
Diagonal blocks call it with ``is_causal=True``, full blocks with ``False``. Partial outputs and
log-sum-exps are merged in fp32; the output is saved in the inputs' dtype (the kernels' backward
reads it in that dtype).

**Backward** (the flash-attention gradient per block, with the saved final O and ℓ):
with D = rowsum(dO ∘ O), P = exp(s − ℓ), dV_b = Pᵀ·dO, dP = dO·V_bᵀ, dS = P ∘ (dP − D),
dQ += dS·K_b·scale and dK_b = dSᵀ·Q·scale — the kernels' own backward, called per block with the
*merged* O and ℓ in place of the block's. dQ and the k/v gradients accumulate in fp32. The k/v
blocks ring again; their gradients travel with them and one last shift takes each home: C − 1
k/v sends and C gradient sends per rank. Both overlap the computation: at step j the next k/v
block is in flight while the block in hand is computed, and so is that block's gradient from the
ranks before (sent at their step j − 1): this rank computes its own share into a fresh buffer,
then adds the arrived partial and sends the sum on, which arrives while step j + 1 computes.

Communication per rank and layer (:func:`gridshard.theory.context.ring_attention_sends`): forward
C − 1 sends of one k/v block, backward C − 1 k/v sends and C sends of the fp32 k/v gradient.

Why hand-written: PyTorch's ring attention (``torch.distributed.tensor.experimental``) is a
private, experimental API that patches ``scaled_dot_product_attention`` process-wide and has no
CPU kernel path; this one is a plain autograd function over a gridshard axis, recorded in the
ledger, on the kernels above on both CPU and CUDA.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm.ledger import record
from .blocks import block_kernel
from .sequence_split import chunk_indices

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
    """(local query chunk, local key chunk, causal) for the blocks computed at source ``src``: under the
    causal mask query chunk a sees all of key chunk b < a, the lower triangle of b = a, nothing of b > a."""
    return [(qi, ki, kc == qc) for qi, qc in enumerate(chunk_indices(C, rank))
            for ki, kc in enumerate(chunk_indices(C, src)) if kc <= qc]


def _ring_steps(kv: torch.Tensor, axis):
    """Per ring step j = 0 … C − 1: (keys' chunks, values' chunks, :func:`_pairs`) of the k/v block in
    hand, from rank (r − j) mod C; the next block is in flight meanwhile, waited for on resuming."""
    C, r = axis.size, axis.rank
    ring = _Ring(axis) if C > 1 else None
    for j in range(C):
        pending = ring.start(kv) if j < C - 1 else None
        yield kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2), _pairs(C, r, (r - j) % C)
        if pending is not None:
            kv = ring.wait(pending)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's 2c queries against all keys of the sequence (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, scale):
        kernel = block_kernel(q)
        qs = q.chunk(2, dim=2)
        out = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for x in qs]
        for ks, vs, pairs in _ring_steps(torch.stack([k, v]), axis):
            for qi, ki, causal in pairs:
                o_b, l_b = kernel.forward(qs[qi], ks[ki], vs[ki], scale, causal)
                new = torch.logaddexp(lse[qi], l_b)
                out[qi] = out[qi] * torch.exp(lse[qi] - new).unsqueeze(-1) + o_b * torch.exp(l_b - new).unsqueeze(-1)
                lse[qi] = new
        o = torch.cat(out, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        ctx.axis, ctx.scale = axis, scale
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        kernel = block_kernel(q)
        c = q.shape[2] // 2
        qs, dOs, os_ = (t.chunk(2, dim=2) for t in (q, grad_out.to(q.dtype).contiguous(), o))
        lses = [x.contiguous() for x in lse.chunk(2, dim=2)]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        ring = _Ring(axis) if axis.size > 1 else None
        arriving = None                                 # the block's gradient from the ranks before, in flight
        for ks, vs, pairs in _ring_steps(kv, axis):
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qi, ki, causal in pairs:
                dq_b, dk_b, dv_b = kernel.backward(dOs[qi], qs[qi], ks[ki], vs[ki], os_[qi], lses[qi], scale, causal)
                dq[:, :, qi * c:(qi + 1) * c] += dq_b
                dkv[0, :, :, ki * c:(ki + 1) * c] += dk_b
                dkv[1, :, :, ki * c:(ki + 1) * c] += dv_b
            if arriving is not None:
                dkv += ring.wait(arriving)
            if ring is not None:                        # on with its block; it arrives while the next block computes
                arriving = ring.start(dkv, tag=1)
        if ring is not None:
            dkv = ring.wait(arriving)                   # the last shift takes each block's gradient home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


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
