"""Cross-entropy of a classifier's logits (one label per input), in every tensor mode.

The classifier heads (:class:`gridshard.tensor.tp1d.classifier.Classifier1D`,
:class:`gridshard.tensor.tp2d.classifier.ClsClassifier2D`) give every tensor rank *full* logits
[b', K] for its inputs, K classes:

======  ========================  ==========================================================
mode    logits / labels per rank  loss (the same scalar on every tensor rank)
======  ========================  ==========================================================
none    [b, K] / [b]              Σ_i ℓ_i, ℓ_i = −log softmax(z_i)[y_i]
1d      [b, K] / [b], the same    the same sum on every rank (replicated head): no collective
        on every tensor rank
2d      [b/q, K] / [b/q]: batch   Σ over the grid row's block, then summed over the q blocks by
        block i, the same on the  ``reduce_from_group`` along the column (forward all-reduce of
        q ranks of row i          one number, backward identity: rank (i, j) backpropagates
                                  its own block's logits only, as every rank of the grid holds
                                  the same total)
3d      [b/q², K] / [b/q²]:       :func:`gridshard.tensor.tp3d.vision.classification_loss_3d` on the
        the images' batch block   residual orientation ``mesh.cube``: Σ over the block, summed
        i·q + j of the cube       over the q² blocks on its ``batch`` axis
======  ========================  ==========================================================

``reduction="mean"`` divides by N, the labels ≠ ``ignore_index`` of the tensor group's batch
(2D: counted per block and summed along the column, one more all-reduce of one number, no
gradient); N = 0 gives NaN with a zero gradient, as ``F.cross_entropy``. ``"sum"`` returns the sum
(0 when N = 0), what the trainer uses (:mod:`gridshard.engine.step`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.dual_ops import reduce_from_group
from ..errors import ShapeError


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, axis=None, ignore_index: int = -100,
                        reduction: str = "mean") -> torch.Tensor:
    """The table's loss for this rank's ``logits`` [b', K] and ``labels`` [b'] (module docstring):
    ``axis`` the one the tensor group's batch blocks are summed over (2D: ``mesh.col``; None: one block,
    the scheme's :meth:`~gridshard.tensor.base.Scheme.batch_block_axis`)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ShapeError(f"classification loss: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         f"disagree: logits must be [b, classes] and labels [b]. Fix: pass one label per image "
                         f"(2D: this grid row's batch block, parallel_context.shard_tokens(labels)).")
    total = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    if axis is not None:
        total = reduce_from_group(total, axis)
        with torch.no_grad():
            count = C.all_reduce(count.reshape(1).double(), axis, inplace=True)[0]
    if reduction == "sum":
        return total
    return masked_mean(total, count)


def masked_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count, NaN when count = 0, with a finite upstream weight (zero gradients at N = 0)."""
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))


def correct_count(logits: torch.Tensor, labels: torch.Tensor, axis=None) -> torch.Tensor:
    """How many inputs of the tensor group's batch the classifier gets right (argmax = label), a
    float64 scalar, the same on every tensor rank (each batch block's count summed over ``axis``:
    2D ``mesh.col``, 3D the cube's ``batch``; one all-reduce of one number)."""
    hits = (logits.argmax(-1) == labels).sum().double().reshape(1)
    if axis is not None:
        hits = C.all_reduce(hits, axis, inplace=True)
    return hits[0]
