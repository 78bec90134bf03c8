"""Attention on one (query chunk, key chunk) block with its log-sum-exp, on a fused kernel.

Ring attention (:mod:`gridshard.context.ring_attention`) needs, for each block, the partial output
and the log-sum-exp of every query row,

    O_b = softmax(s_b) · V_b,   ℓ_b = log Σ_k exp(s_b,k),   s_b = q · K_bᵀ · scale (+ causal mask),

and in backward the block's gradients from the *merged* output O and log-sum-exp ℓ of the whole
row (the flash-attention backward: with D = rowsum(dO ∘ O) and P = exp(s_b − ℓ), dV_b = Pᵀ·dO,
dS = P ∘ (dO·V_bᵀ − D), dQ_b = dS·K_b·scale, dK_b = dSᵀ·Q·scale). PyTorch's fused attention ops
compute exactly these without ever holding the n_q × n_k score matrix (they tile it), so a block
costs O(n·d) memory per head instead of O(n_q·n_k):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (any float
  dtype; grouped-query heads natively: query head h reads k/v head h // (H / H_kv));
* CUDA, fp16/bf16, head dim a multiple of 8 up to 256: ``aten._scaled_dot_product_flash_attention``
  and its ``_backward`` (k/v heads expanded to H for grouped-query attention, their gradients
  summed back);
* CUDA otherwise (fp32; head dim a multiple of 8): ``aten._scaled_dot_product_efficient_attention``
  and its ``_backward`` (its log-sum-exp is padded to a multiple of 32 rows: cut in forward,
  padded again for backward);
* everything else (other devices, CUDA head dims the kernels do not take): the plain-matmul
  fallback :data:`MATMUL`, which materialises the n_q × n_k scores in fp32.

A causal block is the diagonal one (n_q = n_k, query i sees keys 0 … i): the kernels' top-left
``is_causal``. Every kernel returns the log-sum-exp in fp32, natural log, shape [b, H, n_q].
Outputs and gradients come in the inputs' dtype; the ring merges and accumulates them in fp32.

**Masks** (document masks, :mod:`gridshard.nn.documents`): instead of ``causal`` a block may take a
boolean ``mask`` [b, 1, n_q, n_k] (True: attend; it carries the causal order itself), added to the
scores as 0 / −∞ in the inputs' dtype. Read from the ops' schemas (torch 2.13):

* CPU: ``_scaled_dot_product_flash_attention_for_cpu(…, *, attn_mask=None, scale=None)`` and its
  ``_backward`` take ``attn_mask`` as an *additive* tensor of the query's dtype (a bool mask is
  refused), broadcast over heads from [b, 1, n_q, n_k]; exact against the matmul block;
* CUDA efficient: ``attn_bias`` (additive, the query's dtype, [b, H, n_q, n_k] with a unit last
  stride and the others multiples of 16 elements: the bias is allocated with its rows padded to 16
  and sliced, then expanded over heads with stride 0 — what SDPA's own ``preprocess_mask`` does);
  the backward takes the same bias and is asked for no bias gradient;
* CUDA flash takes no mask: a masked block on CUDA runs the efficient kernel (or the matmul
  fallback), :func:`block_kernel` with ``masked=True``.

A mask can empty a row (a query whose document starts after the block's keys). Such a row has no
partial: O_b = 0 and ℓ_b = −∞ (the CPU kernel itself returns ℓ = 0 there, which would weigh a zero
output as exp(0) in the merge), so every kernel's forward sets them from the mask. In backward the
ring passes the *merged* ℓ of the row, finite (every row keeps its diagonal key), so the masked
scores give P = exp(−∞ − ℓ) = 0 and the block contributes nothing to dQ, dK, dV there.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

aten = torch.ops.aten


class BlockKernel(NamedTuple):
    """``forward(q, k, v, scale, causal, mask=None) → (O_b, ℓ_b)`` and
    ``backward(dO, q, k, v, O, ℓ, scale, causal, mask=None) → (dQ_b, dK_b, dV_b)``; q [b, H, n_q, d],
    k/v [b, H_kv, n_k, d], gradients shaped like their inputs; ``mask`` bool [b, 1, n_q, n_k] or None
    (then ``causal`` must be False: the mask carries the order)."""
    name: str
    forward: Callable
    backward: Callable


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """k/v heads repeated for grouped-query attention: head h reads k/v head h // groups."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: the query heads' k/v gradients summed onto their k/v head."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.reshape(b, h // groups, groups, n, d).sum(2)


def _additive(mask, dtype, align: int = 1):
    """The boolean ``mask`` as scores to add (0 where True, −∞ where False) in ``dtype``; its rows
    allocated ``align``-element aligned (the CUDA efficient kernel's stride rule), then sliced."""
    n_k = mask.shape[-1]
    bias = torch.zeros(*mask.shape[:-1], n_k + (-n_k % align), dtype=dtype, device=mask.device)[..., :n_k]
    return bias.masked_fill_(~mask, float("-inf"))


def _scores(q, k, scale, causal, mask=None):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        m = s.shape[-1]
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _matmul_forward(q, k, v, scale, causal, mask=None):
    """Fallback: the scores in fp32, materialised (n_q × n_k per head)."""
    g = q.shape[1] // k.shape[1]
    s = _scores(q.float(), _expand(k.float(), g), scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))      # an empty row: P = 0
    return torch.matmul(p, _expand(v.float(), g)), lse


def _matmul_backward(dO, q, k, v, o, lse, scale, causal, mask=None):
    """Fallback: the flash-attention gradient (module doc) with materialised fp32 scores."""
    g = q.shape[1] // k.shape[1]
    qf, dOf, ke, ve = q.float(), dO.float(), _expand(k.float(), g), _expand(v.float(), g)
    p = torch.exp(_scores(qf, ke, scale, causal, mask) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dOf)
    ds = p * (torch.matmul(dOf, ve.transpose(-1, -2)) - (dOf * o.float()).sum(-1, keepdim=True))
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return torch.matmul(ds, ke) * scale, _fold(dk, g), _fold(dv, g)


def _cpu_forward(q, k, v, scale, causal, mask=None):
    bias = None if mask is None else _additive(mask, q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dO, q, k, v, o, lse, scale, causal, mask=None):
    bias = None if mask is None else _additive(mask, q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dO, q, k, v, o, lse, 0.0, causal,
                                                                     attn_mask=bias, scale=scale)


def _no_mask(mask):
    if mask is not None:
        raise ValueError("CUDA flash attention takes no mask. Fix: run masked blocks on "
                         "block_kernel(q, masked=True) (the efficient kernel or the matmul fallback).")


def _flash_forward(q, k, v, scale, causal, mask=None):
    _no_mask(mask)
    g = q.shape[1] // k.shape[1]
    return aten._scaled_dot_product_flash_attention(q, _expand(k, g), _expand(v, g), 0.0, causal, False,
                                                    scale=scale)[:2]


def _flash_backward(dO, q, k, v, o, lse, scale, causal, mask=None):
    """Dense (not variable-length) flash backward: no cumulative lengths, no dropout seeds used."""
    _no_mask(mask)
    g = q.shape[1] // k.shape[1]
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dO, q, _expand(k, g), _expand(v, g), o, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
        seed, offset, scale=scale)
    return dq, _fold(dk, g), _fold(dv, g)


def _efficient_bias(q, mask):
    """``mask`` as the efficient kernel's ``attn_bias`` [b, H, n_q, n_k] (module doc), or None."""
    return None if mask is None else _additive(mask, q.dtype, align=16).expand(-1, q.shape[1], -1, -1)


def _efficient_forward(q, k, v, scale, causal, mask=None):
    g = q.shape[1] // k.shape[1]
    res = aten._scaled_dot_product_efficient_attention(q, _expand(k, g), _expand(v, g), _efficient_bias(q, mask),
                                                       True, 0.0, causal, scale=scale)
    return res[0], res[1][..., :q.shape[2]]


def _efficient_backward(dO, q, k, v, o, lse, scale, causal, mask=None):
    """The kernel reads a log-sum-exp padded to a multiple of 32 rows (as its forward returns)."""
    g = q.shape[1] // k.shape[1]
    n = q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, -n % 32)).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dO, q, _expand(k, g), _expand(v, g), _efficient_bias(q, mask), o, lse, seed, seed.clone(), 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, _fold(dk, g), _fold(dv, g)


def _empty_rows_safe(forward: Callable) -> Callable:
    """``forward`` with the mask contract (module doc): rows the mask empties get O_b = 0, ℓ_b = −∞."""
    def run(q, k, v, scale, causal, mask=None):
        if mask is None:
            return forward(q, k, v, scale, causal)
        if causal:
            raise ValueError("a block got both causal=True and a mask. Fix: put the causal order into the "
                             "mask (gridshard.nn.documents.attention_mask with the tokens' positions).")
        o, lse = forward(q, k, v, scale, False, mask)
        empty = ~mask.any(-1)                                           # [b, 1, n_q], over the heads
        return o.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))
    return run


CPU = BlockKernel("cpu_flash", _empty_rows_safe(_cpu_forward), _cpu_backward)
CUDA_FLASH = BlockKernel("cuda_flash", _empty_rows_safe(_flash_forward), _flash_backward)
CUDA_EFFICIENT = BlockKernel("cuda_efficient", _empty_rows_safe(_efficient_forward), _efficient_backward)
MATMUL = BlockKernel("matmul", _empty_rows_safe(_matmul_forward), _matmul_backward)


def block_kernel(q: torch.Tensor, masked: bool = False) -> BlockKernel:
    """The block kernel for ``q``'s device, dtype and head dim (module doc lists where each applies);
    ``masked``: for blocks with a mask (never CUDA flash)."""
    d = q.shape[-1]
    if q.device.type == "cpu" and q.dtype.is_floating_point:
        return CPU
    if q.device.type == "cuda" and d % 8 == 0:
        if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and not masked:
            return CUDA_FLASH
        if q.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return CUDA_EFFICIENT
    return MATMUL
