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

All-to-all attention (:mod:`gridshard.context.all_to_all`) trades sequence for heads: forward one
all-to-all each for q (b·H·2c·d elements), k and v (b·H_kv·2c·d each) and the output (b·H·2c·d);
backward the same four, inverted. Payload = the rank's local tensor; (C − 1)/C of it leaves the
rank. Per rank and direction: 4 calls, b·2c·d·(2H + 2H_kv)·bytes_per_elem.
"""
from __future__ import annotations


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


def all_to_all_attention_volume(C: int, b: int, local_tokens: int, heads: int, kv_heads: int, head_dim: int,
                                bytes_per_elem: int = 4) -> dict:
    """{"forward": (calls, payload bytes), "backward": (calls, payload bytes)} of one layer's
    all-to-alls per rank (module docstring)."""
    if C == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    per_direction = b * local_tokens * head_dim * (2 * heads + 2 * kv_heads) * bytes_per_elem
    return {"forward": (4, per_direction), "backward": (4, per_direction)}
