"""Cross-entropy over vocabulary-parallel logits, without gathering the vocabulary.

Rank t holds the logit columns [start_t, start_t + V_l) of the (padded) vocabulary,
z_t [N, V_l] for N tokens; columns ≥ V (padding) are excluded. For token i with
target y_i the loss is

    ℓ_i = log Σ_j exp(z_ij) − z_{i,y_i} = log S_i − (z_{i,y_i} − m_i),   S_i = Σ_j exp(z_ij − m_i)

computed with three reductions over the tensor group, none of them vocabulary-sized:

1. m_i = max_t max_{j∈t} z_ij                 all-reduce(max) of N floats
2. S_i and z_{i,y_i} − m_i (the owner rank contributes it, the others 0)
                                              one all-reduce(sum) of 2N floats

so the loss costs 3·N·4 bytes of all-reduce payload (fp32) per forward, and the
backward none: ∂ℓ_i/∂z_ij = softmax_ij − [j = y_i] is computed on the local shard
from the saved local softmax. Tokens whose target is ``ignore_index`` get ℓ_i = 0
and a zero gradient (as ``F.cross_entropy(reduction="none")``).

:func:`vocab_parallel_cross_entropy` returns the PER-TOKEN loss (targets' shape);
``ParallelContext.loss`` (mode ``1d``) reduces it: Σ_i ℓ_i (``reduction="sum"``) or
Σ_i ℓ_i / max(N, 1) with N = #non-ignored targets (``"mean"``; its value is NaN when
N = 0, as ``F.cross_entropy``'s, but its gradient stays exactly 0: the upstream weight
1/max(N, 1) is finite, and every ignored token's gradient is multiplied by valid = 0 —
dividing by N itself would send ∞·0 = NaN into every gradient).

The targets are the same on every tensor rank (replicated, also under sequence
parallelism), so the id range check below answers alike on every rank.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...comm import collectives as C
from ...errors import ShapeError
from ...mesh import Axis
from .embedding import check_token_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, axis, vocab_start, vocab_size, ignore_index):
        z = logits.float()
        n_local = z.shape[-1]
        n_real = max(0, min(n_local, vocab_size - vocab_start))      # non-padding columns of this shard
        if n_real < n_local:
            z = z.clone()
            z[:, n_real:] = float("-inf")
        local_max = z.max(dim=-1).values
        gmax = C.all_reduce(local_max, axis, op="max", inplace=True)
        shifted = z - gmax.unsqueeze(-1)
        exp = shifted.exp()                                          # padding → exp(−inf) = 0
        local_target = targets - vocab_start
        mine = (targets != ignore_index) & (local_target >= 0) & (local_target < n_real)
        idx = local_target.masked_fill(~mine, 0)
        target_shifted = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = C.all_reduce(torch.stack([exp.sum(dim=-1), target_shifted]), axis, inplace=True)
        sum_exp, target_logit = sums[0], sums[1]
        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid.to(grad_loss.dtype)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, mesh_or_axis,
                                 ignore_index: int = -100, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token cross-entropy of vocab-parallel logits (shape of ``targets``; 0 where ignored).

    ``local_logits`` [.., V_l]: this rank's vocabulary block (rank t holds columns
    t·V_l … (t+1)·V_l − 1 of the padded vocabulary, as a ColumnParallelLinear /
    tied VocabParallelEmbedding head produces). ``targets`` [..]: global ids, the same
    on every tensor rank. ``vocab_size``: the real vocabulary V; columns ≥ V are
    padding and excluded (default: no padding, V = T·V_l). The result is identical on
    every tensor rank. Never holds more than [N, V_l] logits on a rank.
    """
    axis: Axis = getattr(mesh_or_axis, "tensor", mesh_or_axis)
    T, n_local = axis.size, local_logits.shape[-1]
    padded = T * n_local
    vocab_size = padded if vocab_size is None else vocab_size
    if tuple(local_logits.shape[:-1]) != tuple(targets.shape):
        raise ShapeError(f"vocab_parallel_cross_entropy: logits {tuple(local_logits.shape)} and targets "
                         f"{tuple(targets.shape)} disagree: logits must be targets' shape + [vocab/T]. Fix: pass "
                         f"the targets of the same tokens (the full sequence, also under sequence parallelism).")
    if not (padded - T < vocab_size <= padded):
        raise ShapeError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size} does not fit local logits of "
                         f"{n_local} columns × T={T} (= {padded} padded columns): the padded vocabulary must be "
                         f"⌈V/T⌉·T. Fix: pass the vocab_size the head was built with.")
    check_token_range(targets, vocab_size, "vocab_parallel_cross_entropy targets", ignore_index)
    # Logits of a sequence-parallel model come stored sequence-first ([b, s, V_l] view of a
    # contiguous [s, b, V_l]): flatten the tokens in that order, so no copy of the logits is made.
    seq_first = local_logits.dim() == 3 and not local_logits.is_contiguous() \
        and local_logits.transpose(0, 1).is_contiguous()
    if seq_first:
        local_logits, targets_in = local_logits.transpose(0, 1), targets.transpose(0, 1)
    else:
        targets_in = targets
    flat_logits = local_logits.reshape(-1, n_local)
    flat_targets = targets_in.reshape(-1).long()
    loss = _VocabParallelCrossEntropy.apply(flat_logits, flat_targets, axis, axis.rank * n_local,
                                            vocab_size, ignore_index)
    loss = loss.reshape(targets_in.shape)
    return loss.transpose(0, 1) if seq_first else loss
