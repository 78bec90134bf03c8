"""Context parallelism: what one attention layer moves per rank (:mod:`gridshard.context`).

Ring attention on C ranks, b sequences, 2c local tokens per rank (S = 2c·C), H_kv k/v heads of
dimension d, k/v elements of ``bytes_per_elem`` bytes. One k/v block is

    B_kv = 2 · b · H_kv · 2c · d · bytes_per_elem            (keys and values of 2c tokens)

and its gradient travels in fp32: B_dkv = 2 · b · H_kv · 2c · d · 4. Per rank:

* forward: C − 1 sends of B_kv (the last block is never passed on);
* backward: C − 1 sends of B_kv (the blocks ring again) and C sends of B_dkv (the gradients ride
  along and one last shift takes each home).

Every send is also a receive of the same size from the other neighbour; the ledger records the
send (op ``send``, payload = wire bytes). C = 1 moves nothing.

With document masks the ring sends chunks (half a block: c tokens) only as far as they are needed
(:mod:`gridshard.context.ring_attention`, "Document masks"). Chunk b (global index; owner
o_b = b for b < C, 2C − 1 − b otherwise) has the route (f_b, L_b): the ring distances of its first
and furthest consumer ((1, 0): none). With B_c = 2·b·H_kv·c·d·bytes_per_elem, G_c = 2·b·H_kv·c·d·4
and d_b(r) = (r − o_b) mod C, rank r sends

* forward: B_c · #{b : d_b(r) < L_b}                       (it forwards b at step d_b(r));
* backward: the same k/v sends again, plus G_c · #{b : L_b ≥ 1, f_b ≤ d_b(r) ≤ L_b}
  (the gradient partial rides from the first consumer to the route's end, which sends it home).

Calls: one message per step and kind that carries a chunk (the two chunks of one source travel
together): forward #{j : some b of source r − j has j < L_b}; backward that, plus
#{j : some b has f_b ≤ j < L_b} (partials on) and #{j : some b has j = L_b ≥ 1} (sums home).
Without documents every route is (0, C − 1) and this is :func:`ring_attention_sends` exactly.

All-to-all attention (:mod:`gridshard.context.all_to_all`) trades sequence for heads: forward one
all-to-all each for q (b·H·2c·d elements), k and v (b·H_kv·2c·d each) and the output (b·H·2c·d);
backward the same four, inverted. Payload = the rank's local tensor; (C − 1)/C of it leaves the
rank. Per rank and direction: 4 calls, b·2c·d·(2H + 2H_kv')·bytes_per_elem, with H_kv' the
k/v heads traded (:func:`gridshard.job_layout.traded_kv_heads`: H_kv, or C when H_kv < C divides it
and each head is replicated C/H_kv times).
"""
from __future__ import annotations

from ..job_layout import traded_kv_heads


def ring_block_bytes(b: int, local_tokens: int, kv_heads: int, head_dim: int, bytes_per_elem: int) -> int:
    """B: keys and values of one rank's ``local_tokens`` = 2c tokens."""
    return 2 * b * kv_heads * local_tokens * head_dim * bytes_per_elem


def ring_attention_sends(C: int, b: int, local_tokens: int, heads: int, kv_heads: int, head_dim: int,
                         bytes_per_elem: int = 4) -> dict:
    """{"forward": (calls, bytes), "backward": (calls, bytes)} of one layer's ring sends per rank."""
    if C == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    kv = ring_block_bytes(b, local_tokens, kv_heads, head_dim, bytes_per_elem)
    dkv = ring_block_bytes(b, local_tokens, kv_heads, head_dim, 4)
    return {"forward": (C - 1, (C - 1) * kv), "backward": (2 * C - 1, (C - 1) * kv + C * dkv)}


def ring_route_sends(C: int, b: int, local_tokens: int, kv_heads: int, head_dim: int, routes: list,
                     bytes_per_elem: int = 4) -> list:
    """Per context rank r = 0 … C − 1: {"forward": (calls, bytes), "backward": (calls, bytes)} of one
    layer's ring sends under document masks, from ``routes`` [(f_b, L_b)] per global chunk b = 0 … 2C − 1
    (:func:`gridshard.context.ring_attention.chunk_routes` of the ids; formula in the module docstring)."""
    if len(routes) != 2 * C:
        raise ValueError(f"{len(routes)} chunk routes for C={C}: need one per chunk, 2·C = {2 * C}. Fix: pass "
                         f"gridshard.context.ring_attention.chunk_routes(documents, C).")
    kv = ring_block_bytes(b, local_tokens // 2, kv_heads, head_dim, bytes_per_elem)
    grad = ring_block_bytes(b, local_tokens // 2, kv_heads, head_dim, 4)
    out = []
    for r in range(C):
        steps = [[routes[(r - j) % C], routes[2 * C - 1 - (r - j) % C]] for j in range(C)]   # source r − j's chunks
        fwd = [sum(j < L for _, L in steps[j]) for j in range(C)]
        on = [sum(f <= j < L for f, L in steps[j]) for j in range(C)]
        home = [sum(j == L >= 1 for _, L in steps[j]) for j in range(C)]
        calls = sum(n > 0 for n in fwd)
        out.append({"forward": (calls, sum(fwd) * kv),
                    "backward": (calls + sum(n > 0 for n in on) + sum(n > 0 for n in home),
                                 sum(fwd) * kv + (sum(on) + sum(home)) * grad)})
    return out


def all_to_all_attention_volume(C: int, b: int, local_tokens: int, heads: int, kv_heads: int, head_dim: int,
                                bytes_per_elem: int = 4) -> dict:
    """{"forward": (calls, payload bytes), "backward": (calls, payload bytes)} of one layer's
    all-to-alls per rank (module docstring)."""
    if C == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    kv = traded_kv_heads(kv_heads, C)
    per_direction = b * local_tokens * head_dim * (2 * heads + 2 * kv) * bytes_per_elem
    return {"forward": (4, per_direction), "backward": (4, per_direction)}


def context_attention_saved_bytes(C: int, token_rows: int, heads: int, head_dim: int, e: int,
                                  recompute: str = "none", kv_heads: int = 0, mode: str = "ring") -> int:
    """Activation bytes one decoder layer keeps at C > 1 beyond the C = 1 layer of the same local
    tokens (:func:`gridshard.theory.memory.layer_saved_tensors`, which takes N = b·S/C tokens per
    rank: every per-token tensor shrinks by C). ``token_rows`` n = b·2c (2D: over q), ``heads`` H_r
    the rank's query heads, ``e`` the activation element bytes.

    What each mode keeps for backward, recompute ``none`` (read from the code):

    * ring (:class:`gridshard.context.ring_attention.RingAttention`): the rotated q, k, v (as causal
      SDPA does at C = 1), its merged output O in the input dtype (n·H_r·d·e) and the fp32
      log-sum-exp (n·H_r·4, as SDPA's). The k/v blocks of other ranks are *not* kept: backward
      rings them again.
    * all-to-all (:mod:`gridshard.context.all_to_all`): the trades keep nothing; SDPA on the
      traded [b, H_r/C, S, d] tensors keeps q, k, v, its output and log-sum-exp, the same bytes
      as at C = 1 for the rank's n tokens.

    In both, the output reaches o_proj as a contiguous [b, H_r, 2c, d] tensor, so
    ``transpose(1, 2).reshape`` copies it and o_proj keeps the copy (n·H_r·d·e), where at C = 1 it
    keeps a view of SDPA's output, whose memory is already in the sequence-major layout. Hence::

        extra = n·H_r·d·e        (none)        0  (selective, full: the core is recomputed and
                                                    its output reaches o_proj the same way)

    and under all-to-all with ``kv_heads`` H_kv < C replicated to C heads
    (:func:`gridshard.job_layout.traded_kv_heads`), SDPA keeps the traded k and v of C heads where
    the C = 1 count has H_kv: + 2·n·(C − H_kv)·d·e (recompute none; selective keeps the core's
    un-replicated inputs). C = 1: 0."""
    if C == 1 or recompute != "none":
        return 0
    replicated = traded_kv_heads(kv_heads, C) - kv_heads if mode == "all_to_all" and kv_heads else 0
    return token_rows * heads * head_dim * e + 2 * token_rows * replicated * head_dim * e


def context_transient_bytes(C: int, mode: str, b: int, local_tokens: int, heads: int, kv_heads: int,
                            head_dim: int, e: int) -> int:
    """Attention working memory alive at the peak of a C > 1 backward beyond what is saved
    (the ring's buffers; all-to-all's traded copies), per rank: ``local_tokens`` = 2c.

    * ring backward (:meth:`RingAttention.backward`): the stacked k/v block in hand and the one in
      flight (2·B_kv, B_kv = 2·b·H_kv·2c·d·e), three fp32 k/v gradient blocks (3·B_dkv: the one this
      step fills, the one it sent on and the one arriving, both in flight while it computes), the
      fp32 dq accumulator (b·H·2c·d·4) and the contiguous dO (b·H·2c·d·e);
      the block kernel's own workspace is tiled (O(block)), not counted;
    * all-to-all backward: the output gradient traded to [b, H/C, S, d] and the q, k, v gradients
      traded back, b·2c·d·(2H + 2H_kv)·e (twice: the exchange's send and receive buffers).

    C = 1: 0."""
    if C == 1:
        return 0
    kv = ring_block_bytes(b, local_tokens, kv_heads, head_dim, e)
    if mode == "all_to_all":
        return 2 * b * local_tokens * head_dim * (2 * heads + 2 * traded_kv_heads(kv_heads, C)) * e
    dkv = ring_block_bytes(b, local_tokens, kv_heads, head_dim, 4)
    return 2 * kv + 3 * dkv + b * heads * local_tokens * head_dim * (4 + e)
