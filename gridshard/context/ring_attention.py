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

**Document masks** (``documents``: the ids [b, S] of the whole sequence, which every context rank
holds, :mod:`gridshard.nn.documents`). Query chunk a attends key chunk b ≤ a under the block mask
``attention_mask`` of their ids and global indices; the pair is computed only if the mask is
non-empty in some row (:func:`gridshard.nn.documents.chunk_blocks`, ``blocks_meet`` for all pairs
at once), with no mask (plain causal or full) when keys and queries lie in one document in every
row. A masked block holds its mask while it computes: b·c² bools and b·c² scores to add in the
inputs' dtype (one per row, shared by the heads; a score matrix would be H times that, per block).
Nothing else needs sending, so each k/v *chunk* b (owner o_b, the rank holding it) gets a
route from the ids alone: its consumers are the distances d ∈ D_b ⊆ {1 … C − 1} (ring order from
its owner) of the ranks with a query chunk it meets, and (:func:`chunk_routes`)

    L_b = max D_b   (the furthest consumer; 0 if none),   f_b = min D_b   (the first).

* k/v, forward and again in backward: rank o_b + d forwards chunk b at step d iff d < L_b. At each
  step a rank sends the chunks of its source still going on, in one message (none: no message), and
  receives those its predecessor sends — both decide from the ids, so sends and receives pair up
  with no message about them.
* k/v gradients, backward: the owner keeps its own share of chunk b's gradient; the gradient's
  partial sum starts at the first consumer, o_b + f_b, rides the ring with the chunk, each rank
  adding its share (relays add nothing), and the route's end, o_b + L_b, sends the sum *straight
  home* to o_b (tag 2; a direct point-to-point, the ring's next hop when L_b = C − 1). Each
  rank's home messages arrive from the ranks o + L_b at step L_b, one per distinct L_b. Exact:
  every share is added once, in ring order.

Per rank r, with d_b(r) = (r − o_b) mod C, chunk bytes B_c (k/v) and G_c (fp32 gradient):
forward B_c·#{b : d_b(r) < L_b}, backward that again plus G_c·#{b : f_b ≤ d_b(r) ≤ L_b, L_b ≥ 1}
(:func:`gridshard.theory.context.ring_route_sends`). Without documents every chunk has the route
f = 0, L = C − 1 (the owner's share rides too): exactly the whole-block ring above.

Under ``train.compile`` the ring runs eagerly (``torch.compiler.disable``): its point-to-point calls
break the graph anyway, and with document masks which blocks it computes, with or without a mask,
depends on the batch, so a traced ring would compile again for new batches.

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
from ..nn.documents import attention_mask, check_documents, chunk_blocks
from .blocks import block_kernel
from .sequence_split import chunk_indices

KV, GRAD, HOME = 0, 1, 2                                # point-to-point tags: k/v ring, gradient ring, gradient home


def _owner(b: int, C: int) -> int:
    """The context rank holding global chunk ``b`` (rank i holds chunks i and 2C − 1 − i)."""
    return b if b < C else 2 * C - 1 - b


def _routes(meets: list, C: int) -> list:
    """(f_b, L_b) per global chunk b from ``meets`` [key chunk][query chunk] (module doc); (1, 0): no
    consumer but its owner."""
    routes = []
    for b in range(2 * C):
        o = _owner(b, C)
        dists = [d for d in range(1, C) if any(meets[b][a] for a in chunk_indices(C, (o + d) % C))]
        routes.append((dists[0], dists[-1]) if dists else (1, 0))
    return routes


def chunk_routes(documents: torch.Tensor, C: int) -> list:
    """[(f_b, L_b)] per global chunk b = 0 … 2C − 1 of ``documents`` [b, S] split over C context
    ranks: the ring distances of chunk b's first and furthest consumer (module doc)."""
    return _routes(chunk_blocks(documents, 2 * C)[0], C)


class _Plan:
    """What each ring step computes, sends and receives, known to every rank (module doc)."""

    def __init__(self, axis, c: int, documents: Optional[torch.Tensor]):
        C, n = axis.size, 2 * axis.size
        self.C, self.rank, self.c, self.docs = C, axis.rank, c, documents
        if documents is None:                           # causal only: whole blocks the whole way round
            self.meets = self.whole = [[k <= q for q in range(n)] for k in range(n)]
            self.route = [(0, C - 1)] * n
        else:
            self.meets, self.whole = chunk_blocks(documents, n)
            self.route = _routes(self.meets, C)

    def _chunks(self, rank: int, keep) -> list:
        """Local indices (0, 1) of rank ``rank``'s chunks whose route (f, L) passes ``keep``."""
        return [i for i, b in enumerate(chunk_indices(self.C, rank % self.C)) if keep(*self.route[b])]

    def kv_sent(self, src: int, j: int) -> list:
        """Chunks of ``src`` that the rank holding them at step j sends on: j < L."""
        return self._chunks(src, lambda f, L: j < L)

    def gradient_sent(self, src: int, j: int) -> list:
        """Chunks of ``src`` whose gradient partial the rank at step j sends on: f ≤ j < L."""
        return self._chunks(src, lambda f, L: f <= j < L)

    def home_at(self, j: int) -> list:
        """This rank's chunks whose route ends at step j ≥ 1: their sums come home from rank r + j."""
        return self._chunks(self.rank, lambda f, L: j == L >= 1)

    def fate(self, src: int, i: int, j: int):
        """Where the gradient share of chunk i of ``src`` computed at step j goes: "own" (the owner
        keeps it), "ring" (on with the chunk), "home" (the route's end sends the sum to the owner) or
        None (a relay before the first consumer: nothing to add)."""
        f, L = self.route[chunk_indices(self.C, src)[i]]
        if j < f:
            return "own" if j == 0 else None
        if j < L:
            return "ring"
        return "own" if j == 0 else "home"

    def _mask(self, qc: int, kc: int):
        c, docs = self.c, self.docs
        pos_q, pos_k = (torch.arange(x * c, (x + 1) * c, device=docs.device) for x in (qc, kc))
        return attention_mask(docs[:, qc * c:(qc + 1) * c], docs[:, kc * c:(kc + 1) * c], pos_q, pos_k)

    def pairs(self, src: int, held: list) -> list:
        """(local query chunk, local key chunk, causal, mask or None) of the blocks computed with the
        chunks ``held`` of ``src``: key chunk ≤ query chunk and their mask non-empty in some row."""
        out = []
        for qi, qc in enumerate(chunk_indices(self.C, self.rank)):
            for ki in held:
                kc = chunk_indices(self.C, src)[ki]
                if kc <= qc and self.meets[kc][qc]:
                    plain = self.whole[kc][qc]
                    out.append((qi, ki, plain and kc == qc, None if plain else self._mask(qc, kc)))
        return out


class _Chunks:
    """Some of one rank's two chunks, concatenated along the tokens: ``t`` [2, b, H_kv, n·c, d]
    (k/v or their gradients) holding local chunks ``ids``."""

    def __init__(self, t: Optional[torch.Tensor], ids: list):
        self.t, self.ids = t, list(ids)

    def get(self, i: int) -> torch.Tensor:
        c = self.t.shape[3] // len(self.ids)
        return self.t.narrow(3, self.ids.index(i) * c, c)

    def pick(self, ids: list) -> torch.Tensor:
        return self.t if ids == self.ids else torch.cat([self.get(i) for i in ids], dim=3)


def _start(axis, sends: list, recvs: list) -> tuple:
    """Start point-to-point transfers on ``axis``: ``sends`` [(context rank, tensor, tag)], ``recvs``
    [(context rank, buffer, tag)], every send recorded. Returns the handle :func:`_wait` takes (it
    keeps the tensors in flight alive)."""
    ops = []
    for peer, t, tag in sends:
        record("send", axis, t.numel() * t.element_size(), group_size=2)
        ops.append(dist.P2POp(dist.isend, t.contiguous(), axis.global_rank(peer % axis.size), axis.group, tag))
    for peer, buf, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, axis.global_rank(peer % axis.size), axis.group, tag))
    return [buf for _, buf, _ in recvs], ops, (dist.batch_isend_irecv(ops) if ops else [])


def _wait(handle) -> list:
    bufs, _, works = handle
    for w in works:
        w.wait()
    return bufs


def _kv_steps(kv: torch.Tensor, axis, plan: _Plan):
    """Per ring step j = 0 … C − 1: (j, src, :class:`_Chunks` in hand) — the k/v chunks of rank
    src = (r − j) mod C that come this far (both at j = 0); the next step's are in flight meanwhile."""
    C, r = axis.size, axis.rank
    hand = _Chunks(kv, [0, 1])
    for j in range(C):
        src = (r - j) % C
        pending = None
        if j < C - 1:
            send, recv = plan.kv_sent(src, j), plan.kv_sent(src - 1, j)
            nxt = _Chunks(_buffer(kv, len(recv), kv.dtype), recv)
            pending = _start(axis, [(r + 1, hand.pick(send), KV)] if send else [], [(r - 1, nxt.t, KV)] if recv else [])
        yield j, src, hand
        if pending is not None:
            _wait(pending)
            hand = nxt


def _merge(out, lse, o_b, l_b):
    """The log-sum-exp merge (module doc); a row no key has reached yet (ℓ = −∞ on both sides)
    stays O = 0, ℓ = −∞ instead of exp(−∞ + ∞)."""
    new = torch.logaddexp(lse, l_b)
    base = new.masked_fill(new == float("-inf"), 0)
    return out * torch.exp(lse - base).unsqueeze(-1) + o_b * torch.exp(l_b - base).unsqueeze(-1), new


class RingAttention(torch.autograd.Function):
    """Causal (or document-causal) attention of this rank's 2c queries against all keys of the
    sequence (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, scale, plan):
        kernels = block_kernel(q), block_kernel(q, masked=True)
        qs = q.chunk(2, dim=2)
        out = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for x in qs]
        for _, src, hand in _kv_steps(torch.stack([k, v]), axis, plan):
            for qi, ki, causal, mask in plan.pairs(src, hand.ids):
                kv = hand.get(ki)
                o_b, l_b = kernels[mask is not None].forward(qs[qi], kv[0], kv[1], scale, causal, mask)
                out[qi], lse[qi] = _merge(out[qi], lse[qi], o_b, l_b)
        o = torch.cat(out, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        ctx.axis, ctx.scale, ctx.plan = axis, scale, plan
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        axis, scale, plan = ctx.axis, ctx.scale, ctx.plan
        kernels = block_kernel(q), block_kernel(q, masked=True)
        c = q.shape[2] // 2
        qs, dOs, os_ = (t.chunk(2, dim=2) for t in (q, grad_out.to(q.dtype).contiguous(), o))
        lses = [x.contiguous() for x in lse.chunk(2, dim=2)]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        own = _HomeSum(kv)                              # this rank's dk, dv: its own share and the sums home
        pending = None                                  # the step before's gradient messages, in flight
        for j, src, hand in _kv_steps(kv, axis, plan):
            fates = {i: plan.fate(src, i, j) for i in hand.ids}
            live = [i for i in hand.ids if fates[i]]
            dkv = _Chunks(_buffer(kv, len(live), torch.float32).zero_(), live)
            for qi, ki, causal, mask in plan.pairs(src, hand.ids):
                kv_b = hand.get(ki)
                dq_b, dk_b, dv_b = kernels[mask is not None].backward(dOs[qi], qs[qi], kv_b[0], kv_b[1], os_[qi],
                                                                      lses[qi], scale, causal, mask)
                dq[:, :, qi * c:(qi + 1) * c] += dq_b
                dkv.get(ki)[0] += dk_b
                dkv.get(ki)[1] += dv_b
            if pending is not None:                     # the partials from the ranks before arrived meanwhile
                _collect(pending, dkv, own)
            own.add(dkv, [i for i in live if fates[i] == "own"])
            pending = _send_gradients(axis, plan, j, src, dkv, fates, kv)
        if pending is not None:
            _collect(pending, None, own)
        dkv = own.total()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class _HomeSum:
    """This rank's fp32 dk, dv [2, b, H_kv, 2c, d]: allocated with the first share that stays home,
    or a gradient of both chunks taken over as it is (without documents: the sum arriving home after
    the last step, as the whole-block ring returns it, with no extra buffer)."""

    def __init__(self, like: torch.Tensor):
        self.like, self.t = like, None

    def add(self, chunks: _Chunks, ids: list) -> None:
        if not ids:
            return
        if self.t is None and ids == chunks.ids == [0, 1]:
            self.t = chunks.t
            return
        if self.t is None:
            self.t = _buffer(self.like, 2, torch.float32).zero_()
        for i in ids:
            _Chunks(self.t, [0, 1]).get(i).add_(chunks.get(i))

    def total(self) -> torch.Tensor:
        return _buffer(self.like, 2, torch.float32).zero_() if self.t is None else self.t


def _buffer(like: torch.Tensor, n: int, dtype) -> torch.Tensor:
    """An empty [2, b, H_kv, n·c, d] for n chunks of ``like`` [2, b, H_kv, 2c, d]."""
    shape = list(like.shape)
    shape[3] = shape[3] // 2 * n
    return like.new_empty(shape, dtype=dtype)


def _send_gradients(axis, plan: _Plan, j: int, src: int, dkv: _Chunks, fates: dict, kv: torch.Tensor):
    """Start step j's gradient messages: the partials going on to r + 1 and the sums going home to
    ``src``; receive the predecessor's partials (step j + 1's chunks) and this rank's sums coming home
    from r + j. Returns ([(arriving chunks, tag)], handle) or None."""
    r = axis.rank
    ring, home = ([i for i in dkv.ids if fates[i] == kind] for kind in ("ring", "home"))
    sends = [(peer, dkv.pick(ids), tag) for peer, ids, tag in ((r + 1, ring, GRAD), (src, home, HOME)) if ids]
    arriving = [(peer, _Chunks(_buffer(kv, len(ids), torch.float32), ids), tag)
                for peer, ids, tag in ((r - 1, plan.gradient_sent(src - 1, j), GRAD), (r + j, plan.home_at(j), HOME))
                if ids]
    if not sends and not arriving:
        return None
    return [(ch, tag) for _, ch, tag in arriving], _start(axis, sends, [(p, ch.t, tag) for p, ch, tag in arriving])


def _collect(pending, dkv: Optional[_Chunks], own: _HomeSum) -> None:
    """Wait for ``pending`` gradient messages: partials add to ``dkv`` (this step's chunks), sums home to ``own``."""
    arrived, handle = pending
    _wait(handle)
    for ch, tag in arrived:
        if tag == HOME:
            own.add(ch, ch.ids)
            continue
        for i in ch.ids:
            dkv.get(i).add_(ch.get(i))


@torch.compiler.disable
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis, scale: Optional[float] = None,
                   documents: Optional[torch.Tensor] = None):
    """Causal attention over a sequence split on ``axis`` (the context axis, C ranks).

    ``q`` [b, H, 2c, d], ``k``/``v`` [b, H_kv, 2c, d]: this rank's chunks i and 2C − 1 − i
    (:func:`gridshard.context.sequence_split.shard_sequence`), H divisible by H_kv. Returns this
    rank's [b, H, 2c, d] rows of softmax(q·kᵀ·scale + mask)·v over the whole sequence; ``scale``
    defaults to 1/√d. The mask is causal, or with ``documents`` (int [b, S] ids of the *whole*
    sequence, S = 2c·C, :mod:`gridshard.nn.documents`) document-causal. C = 1 is plain attention
    (no communication)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} k/v heads. Fix: use a "
                         f"number of k/v heads that divides the number of query heads.")
    if q.shape[2] % 2:
        raise ValueError(f"a rank's local sequence of {q.shape[2]} tokens is not two equal chunks. Fix: split "
                         f"the sequence with gridshard.context.sequence_split.shard_sequence.")
    if documents is not None:
        check_documents(documents, (q.shape[0], q.shape[2] * axis.size))
        documents = documents.to(q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, axis, scale, _Plan(axis, q.shape[2] // 2, documents))
