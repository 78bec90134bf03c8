"""Training-step formulas: model FLOPs, data-parallel gradient traffic, MFU.

**FLOPs per token** (forward + backward, dense, the PaLM/Megatron convention). Every
weight of a matmul costs 2 FLOPs per token forward and 4 backward (input grad and
weight grad), so 6 per token. The matmul weights of the reference model are

    N_mm = L·(4h² + 3h·f) + V·h            (qkv 3h², proj h², gate|up 2hf, down hf; lm head)

(the embedding lookup and the norms are not matmuls). Attention adds, per layer and
token, QKᵀ and P·V: 2·s·h + 2·s·h FLOPs forward, ×3 with backward = 12·s·h. The full
square is counted although the causal mask skips half (the usual MFU convention)::

    flops_per_token = 6·N_mm + 12·L·s·h

**MFU** = flops_per_token · tokens_per_s / (peak_flops_per_device · devices).

**Data-parallel gradient all-reduce.** After the last micro-batch each rank sums its
local gradients over the D data ranks, bucket by bucket (flat buffers of at most
``bucket_bytes``), then divides by D. One optimizer step therefore issues ``buckets``
all-reduces whose payloads add up to every local gradient once::

    payload = Σ_params numel_local · bytes_per_elem          (per step, axis "data")
    wire    = 2(D−1)/D · payload                              (ring all-reduce)

independent of the number of micro-batches (accumulation happens locally first).
"""
from __future__ import annotations

import dataclasses

from . import CommVolume


def matmul_params(vocab: int, hidden: int, layers: int, ffn: int, kv_hidden=None) -> int:
    """N_mm = L·(2h² + 2h·h_kv + 3h·f) + V·h, with h_kv = kv_heads·head_dim (= h without
    grouped-query attention, giving L·(4h² + 3h·f) + V·h)."""
    kv = hidden if kv_hidden is None else kv_hidden
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn) + vocab * hidden


def flops_per_token(vocab: int, hidden: int, layers: int, ffn: int, seq_len: int, kv_hidden=None) -> float:
    """6·N_mm + 12·L·s·h (module docstring)."""
    return 6.0 * matmul_params(vocab, hidden, layers, ffn, kv_hidden) + 12.0 * layers * seq_len * hidden


def vit_flops_per_token(hidden: int, layers: int, ffn: int, seq_len: int, patch_elems: int, classes: int) -> float:
    """A Vision Transformer's training FLOPs (forward + backward) per token, counted as
    :func:`flops_per_token` counts a decoder's (matmuls and attention; norms and activations
    left out)::

        6·L·(4h² + 2h·f) + 12·L·s·h + (4·C·P²·h·(s − 1) + 6·K·h) / s

    per layer q, k, v, o (4h²) and the two GELU MLP matrices (2h·f); non-causal attention
    (QKᵀ and AV over all s tokens); the patch projection (``patch_elems`` = C·P² inputs) on the
    s − 1 patch tokens, forward and weight gradient only (the images need no gradient: 4, not 6);
    the classifier (K·h) once per image, on the class token."""
    h, s = hidden, seq_len
    per_layer = 6 * (4 * h * h + 2 * h * ffn) + 12 * s * h
    return layers * per_layer + (4 * patch_elems * h * (s - 1) + 6 * classes * h) / s


def model_flops_per_token(kind: str, mc, seq: int) -> float:
    """Training FLOPs per token of the model family ``kind`` (``model.kind``) for MFU: a decoder's
    :func:`flops_per_token` (SwiGLU, vocabulary head), a ViT's
    :func:`vit_flops_per_token` (GELU MLP, patch projection, classifier). A Mixture-of-Experts
    decoder counts what a token runs: 6 FLOPs per *active* parameter of its MoE layers (router, k
    experts, shared experts) in place of the dense MLP's 3h·f."""
    if kind == "vit":
        return vit_flops_per_token(mc.hidden, mc.layers, mc.ffn_hidden, seq, mc.channels * mc.patch_size ** 2,
                                   mc.num_classes)
    flops = flops_per_token(mc.vocab_size, mc.hidden, mc.layers, mc.ffn_hidden, seq, mc.kv_heads * mc.head_dim)
    if getattr(mc, "experts", 0):
        flops += 6.0 * (mc.num_parameters(active=True) - dataclasses.replace(mc, experts=0).num_parameters())
    return flops


def mfu(flops_token: float, tokens_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation, or None when the device peak is unknown (CPU)."""
    if not peak_flops:
        return None
    return flops_token * tokens_per_s / (peak_flops * devices)


def dp_gradient_allreduce(bucket_elems: list, data_size: int, bytes_per_elem: int = 4) -> CommVolume:
    """One optimizer step's data-parallel gradient all-reduces: one call per bucket,
    payload = Σ bucket elements · bytes (module docstring)."""
    vol = CommVolume(data_size)
    for n in bucket_elems:
        vol.add("all_reduce", n * bytes_per_elem)
    return vol


def bucket_partition(numels: list, bytes_per_elem: int, bucket_bytes: int) -> list:
    """Greedy partition of consecutive gradients into buckets of ≤ ``bucket_bytes``
    (a single larger gradient gets a bucket of its own). Returns lists of indices."""
    buckets, cur, cur_bytes = [], [], 0
    for i, n in enumerate(numels):
        b = n * bytes_per_elem
        if cur and cur_bytes + b > bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
    if cur:
        buckets.append(cur)
    return buckets
