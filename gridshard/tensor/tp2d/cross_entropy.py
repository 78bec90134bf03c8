"""Vocabulary-parallel cross-entropy on the 2D layout; never materialises full-vocab logits.

Rank (i, j) holds logits [b/q, s, V_pad/q] = logits[batch block i, :, vocab block j]
and targets [b/q, s] (batch block i). Columns ≥ ``vocab_size`` are padding: they are
set to −∞ before any statistic, so they contribute nothing to the loss or gradient.

Forward, per token (reductions along ``mesh.row``, the q vocab blocks of a token):

    m = max_row(max_local z)                         (all-reduce max, [b/q, s])
    S = Σ_row Σ_local exp(z − m),  z_t = Σ_row [target in my block]·z[target]
                                                     (one all-reduce of [2, b/q, s])
    ℓ = log S + m − z_t                              (0 where the target is ignored)

Over the *global* micro-batch (all q batch blocks; targets ≠ ignore_index are valid):

    L_sum = Σ_valid ℓ,  N = #valid                   (all-reduced along ``mesh.col``)
    reduction="sum":  loss = L_sum                   (0 when N = 0)
    reduction="mean": loss = L_sum / N               (NaN when N = 0, as F.cross_entropy)

so every rank of the grid returns the same scalar. Backward is local: with upstream g
(the same ∂/∂loss on every rank)

    dz = (softmax(z) − onehot(target)) · valid · w,   w = g (sum) or g / max(N, 1) (mean)

A block, or the whole micro-batch, with no valid target gets exactly zero gradient
(valid = 0 everywhere; the max(N, 1) keeps 0/0 out of the mean's backward, so the
gradient equals F.cross_entropy's zeros instead of NaN).

Target range check that every rank answers alike: the targets differ between batch
blocks, so a rank cannot raise on its own block alone (the other grid rows would wait in
the column all-reduce). Each rank puts its block's verdict into the slots of
:func:`gridshard.nn.id_range.bad_id_slots` (slot i = grid row i), appended to the
column all-reduce of (L_sum, N); after it every rank raises the same error naming the
first bad block and its id (:func:`gridshard.nn.id_range.raise_on_bad_ids`). Until then
a bad target only makes a meaningless (possibly inf) loss, never an index error.

Communication: 3 all-reduces in forward (2 on the row, 1 of (2 + 2q) float64 on the
column), none in backward (``theory.tp2d.cross_entropy2d_comm``). Saved: the softmax
block [b/q, s, V_pad/q] (as PyTorch saves its log-softmax).
"""
from __future__ import annotations

import torch

from ...comm import collectives as C
from ...errors import ShapeError
from ...nn.id_range import bad_id_slots, raise_on_bad_ids

REDUCTIONS = ("mean", "sum")


class _CrossEntropy2DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mesh, vocab_size, ignore_index, reduction):
        z = logits.float()
        vl = z.shape[-1]
        start = mesh.grid_col * vl
        if start + vl > vocab_size:  # this block holds padding columns
            pad = torch.arange(start, start + vl, device=z.device) >= vocab_size
            z = z.masked_fill(pad, float("-inf"))
        m = C.all_reduce(z.max(-1).values, mesh.row, op="max", inplace=True)
        e = torch.exp(z - m.unsqueeze(-1))
        valid = targets != ignore_index
        local = targets - start
        mine = valid & (local >= 0) & (local < vl)
        idx = local.masked_fill(~mine, 0)
        zt = torch.gather(z, -1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        s_zt = C.all_reduce(torch.stack([e.sum(-1), zt]), mesh.row, inplace=True)
        tok = (torch.log(s_zt[0]) + m - s_zt[1]).masked_fill(~valid, 0.0)
        verdict = bad_id_slots(targets, vocab_size, mesh.grid_row, mesh.q, ignore_index)
        stats = torch.cat([torch.stack([tok.sum().double(), valid.sum().double()]), verdict])
        stats = C.all_reduce(stats, mesh.col, inplace=True)
        raise_on_bad_ids(stats[2:], vocab_size, f"{getattr(mesh, 'loss_name', 'cross_entropy_2d')} targets",
                         ignore_index)
        total, count = stats[0].float(), stats[1].float()
        e.div_(s_zt[0].unsqueeze(-1))  # softmax block
        weight = torch.ones_like(count) if reduction == "sum" else 1.0 / count.clamp(min=1.0)
        ctx.save_for_backward(e, idx, mine, valid, weight)
        ctx.in_dtype = logits.dtype
        return total if reduction == "sum" else total / count

    @staticmethod
    def backward(ctx, g):
        p, idx, mine, valid, weight = ctx.saved_tensors
        grad = p.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((valid.to(grad.dtype) * (g * weight)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def check_loss_inputs(name: str, logits: torch.Tensor, targets: torch.Tensor, q: int, vocab_size: int,
                      reduction: str, which_targets: str) -> None:
    """ShapeError, naming ``name``, unless ``reduction`` is known, the logits are the targets' shape plus a
    vocabulary block of at least V/q columns, and the targets are integer ids (``which_targets``: how
    to get this rank's targets, for the fix)."""
    if reduction not in REDUCTIONS:
        raise ShapeError(f"{name}: reduction={reduction!r} is not one of {REDUCTIONS}. Fix: use 'mean' or 'sum'.")
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"{name}: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits "
                         f"must be targets' shape plus a vocabulary block. Fix: pass this rank's targets "
                         f"({which_targets}).")
    if logits.shape[-1] * q < vocab_size:
        raise ShapeError(f"{name}: vocab block {logits.shape[-1]} × q={q} < vocab_size={vocab_size}: each rank must "
                         f"hold V_pad/q ≥ V/q columns. Fix: pass the logits block of a head built for this "
                         f"vocabulary.")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ShapeError(f"{name} targets: ids must be an integer tensor, got dtype {targets.dtype}. "
                         f"Fix: pass .long() ids.")


def cross_entropy_2d(logits: torch.Tensor, targets: torch.Tensor, mesh, vocab_size: int,
                     ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over all global non-ignored targets of the grid's micro-batch, the same
    scalar on every rank: their mean (``reduction="mean"``, NaN with zero gradient when every
    target is ignored, as ``F.cross_entropy``) or their sum (``"sum"``, 0 then)."""
    check_loss_inputs("cross_entropy_2d", logits, targets, mesh.q, vocab_size, reduction,
                      f"batch block {mesh.grid_row}, e.g. model.parallel_context.shard_tokens(targets)")
    # the id range is checked inside the forward, agreed over the column (module docstring)
    return _CrossEntropy2DFn.apply(logits, targets, mesh, vocab_size, ignore_index, reduction)
