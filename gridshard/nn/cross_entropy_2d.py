"""Vocabulary-parallel cross-entropy on the 2D layout; never materialises full-vocab logits.

Rank (i, j) holds logits [b/q, s, V_pad/q] = logits[batch block i, :, vocab block j]
and targets [b/q, s] (batch block i). Columns ≥ ``vocab_size`` are padding: they are
set to −∞ before any statistic, so they contribute nothing to the loss or gradient.

Forward, per token (reductions along ``mesh.row``, the q vocab blocks of a token):

    m = max_row(max_local z)                         (all-reduce max, [b/q, s])
    S = Σ_row Σ_local exp(z − m),  z_t = Σ_row [target in my block]·z[target]
                                                     (one all-reduce of [2, b/q, s])
    ℓ = log S + m − z_t

Loss = Σ_valid ℓ / N_valid over all *global* tokens (targets ≠ ignore_index): the two
sums are all-reduced along ``mesh.col`` (the q batch blocks), so every rank of the
grid returns the same scalar. Backward is local: dz = (softmax(z) − onehot(target))
· valid / N_valid · upstream (each rank's upstream gradient is the same ∂/∂loss).
Communication: 3 all-reduces in forward (2 on the row, 1 of 2 elements on the
column), none in backward. Saved: the softmax block [b/q, s, V_pad/q] (as PyTorch
saves its log-softmax).
"""
from __future__ import annotations

import torch

from ..comm import collectives as C
from ..errors import ShapeError
from .embedding_1d import check_token_range


class _CrossEntropy2DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mesh, vocab_size, ignore_index):
        z = logits.float()
        vl = z.shape[-1]
        start = mesh.grid_col * vl
        if start + vl > vocab_size:  # this block holds padding columns
            pad = torch.arange(start, start + vl, device=z.device) >= vocab_size
            z = z.masked_fill(pad, float("-inf"))
        m = C.all_reduce(z.max(-1).values, mesh.row, op="max")
        e = torch.exp(z - m.unsqueeze(-1))
        valid = targets != ignore_index
        local = targets - start
        mine = valid & (local >= 0) & (local < vl)
        idx = local.masked_fill(~mine, 0)
        zt = torch.gather(z, -1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        s_zt = C.all_reduce(torch.stack([e.sum(-1), zt]), mesh.row)
        tok = (torch.log(s_zt[0]) + m - s_zt[1]).masked_fill(~valid, 0.0)
        totals = C.all_reduce(torch.stack([tok.sum(), valid.sum().to(tok.dtype)]), mesh.col)
        e.div_(s_zt[0].unsqueeze(-1))  # softmax block
        ctx.save_for_backward(e, idx, mine, valid, totals[1])
        ctx.in_dtype = logits.dtype
        return totals[0] / totals[1]

    @staticmethod
    def backward(ctx, g):
        p, idx, mine, valid, count = ctx.saved_tensors
        grad = p.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((valid.to(grad.dtype) * (g / count)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def cross_entropy_2d(logits: torch.Tensor, targets: torch.Tensor, mesh, vocab_size: int,
                     ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over all global non-ignored tokens; the same scalar on every rank."""
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"cross_entropy_2d: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         f"disagree: logits must be targets' shape plus a vocabulary block. Fix: pass this "
                         f"rank's targets (batch block {mesh.grid_row}, e.g. model.parallel_context.shard_tokens(targets)).")
    if logits.shape[-1] * mesh.q < vocab_size:
        raise ShapeError(f"cross_entropy_2d: vocab block {logits.shape[-1]} × q={mesh.q} < vocab_size="
                         f"{vocab_size}: each rank must hold V_pad/q ≥ V/q columns. Fix: pass the logits block "
                         f"of a head built for this vocabulary.")
    check_token_range(targets, vocab_size, "cross_entropy_2d targets", ignore_index)
    return _CrossEntropy2DFn.apply(logits, targets, mesh, vocab_size, ignore_index)
