"""Vocabulary-parallel cross-entropy on the 2.5D layout: the 2D loss of each depth layer,
summed over the layers.

Rank (k, i, j) holds logits [b/(d·q), s, V_pad/q] = logits[batch block k·q + i, :, vocab
block j] and targets [b/(d·q), s]. With d = 1 this is :func:`gridshard.nn.cross_entropy_2d.cross_entropy_2d`
itself (bit for bit). With d > 1, over the whole micro-batch (all d·q batch blocks):

    1. N = #valid targets and the target-range verdicts of every block, one all-reduce over
       ``depth_col`` (my grid column in every layer: each batch block once) of
       (1 + 2·d·q) float64 — before any other collective, so a bad target raises the same
       error on every rank (a depth layer raising alone would leave the others waiting);
    2. s_k = Σ_{valid tokens of layer k} ℓ: the 2D loss with ``reduction="sum"`` on the
       layer's grid (max, Σexp and target logit along ``row``, stats along ``col``;
       stable at any logit magnitude: every exp is of z − max);
    3. S = Σ_k s_k: one all-reduce over ``depth`` of 8 bytes (float64);
    4. loss = S (``"sum"``) or S / N (``"mean"``; NaN when N = 0, as ``F.cross_entropy``),
       the same scalar on every rank.

Backward is local, as in 2D: L = scale·Σ_k s_k with scale = 1 or 1/N, so ∂L/∂s_k = scale
(:func:`gridshard.comm.depth_ops.depth_summed_loss`) and the 2D backward of s_k gives
dz = (softmax(z) − onehot(target))·valid·scale on my block; scale uses max(N, 1), so a
micro-batch with no valid target gets zero gradient.

Communication (d > 1): 2D's sum-loss on N/d tokens + the two calls above
(:func:`gridshard.theory.tp2p5d.cross_entropy2p5d_comm`).
"""
from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.depth_ops import depth_summed_loss
from ..errors import ShapeError
from .cross_entropy_2d import REDUCTIONS, cross_entropy_2d
from .embedding_2p5d import id_verdict_2p5d
from .id_range import raise_on_bad_ids


def _check_args(logits: torch.Tensor, targets: torch.Tensor, mesh, vocab_size: int, reduction: str) -> None:
    """The argument checks, on every rank alike, before any collective."""
    if reduction not in REDUCTIONS:
        raise ShapeError(f"cross_entropy_2p5d: reduction={reduction!r} is not one of {REDUCTIONS}. Fix: use 'mean' "
                         f"or 'sum'.")
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"cross_entropy_2p5d: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         f"disagree: logits must be targets' shape plus a vocabulary block. Fix: pass this rank's "
                         f"targets (batch block {mesh.batch_index} of d·q = {mesh.d * mesh.q}, "
                         f"mesh.batch_block(targets, hidden=False)).")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ShapeError(f"cross_entropy_2p5d targets: ids must be an integer tensor, got dtype {targets.dtype}. "
                         f"Fix: pass .long() ids.")
    if logits.shape[-1] * mesh.q < vocab_size:
        raise ShapeError(f"cross_entropy_2p5d: vocab block {logits.shape[-1]} × q={mesh.q} < vocab_size="
                         f"{vocab_size}: each rank must hold V_pad/q ≥ V/q columns. Fix: pass the logits block "
                         f"of a head built for this vocabulary.")


def cross_entropy_2p5d(logits: torch.Tensor, targets: torch.Tensor, mesh, vocab_size: int,
                       ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every non-ignored target of the 2.5D group's micro-batch, the same
    scalar on every rank: the mean (NaN with zero gradient when all are ignored) or the sum.
    ``mesh`` is a :class:`gridshard.comm.mesh_2p5d.Mesh2p5D` (module docstring)."""
    if mesh.d == 1:
        return cross_entropy_2d(logits, targets, mesh.grid, vocab_size, ignore_index, reduction)
    _check_args(logits, targets, mesh, vocab_size, reduction)
    valid = (targets != ignore_index).sum().to(torch.float64).reshape(1)
    stats = torch.cat([valid, id_verdict_2p5d(targets, vocab_size, mesh, ignore_index)])
    stats = C.all_reduce(stats, mesh.depth_col, inplace=True)
    raise_on_bad_ids(stats[1:], vocab_size, "cross_entropy_2p5d targets", ignore_index)
    part = cross_entropy_2d(logits, targets, mesh.grid, vocab_size, ignore_index, "sum")
    total = C.all_reduce(part.detach().to(torch.float64).reshape(1), mesh.depth, inplace=True)[0]
    if reduction == "sum":
        return depth_summed_loss(part, total, 1.0)
    count = stats[0]
    return depth_summed_loss(part, total / count, (1.0 / count.clamp(min=1.0)).to(part.dtype))
