"""The ViT path in 2.5D: image batch split, patch embedding, classifier and classification loss.

Each layer is the 2D one (:mod:`gridshard.nn.patch_embedding_2d`, :mod:`gridshard.nn.classifier_2d`)
built on my depth layer's grid plus the depth sum of its parameter gradients
(:mod:`gridshard.comm.depth_ops`); rank (k, i, j) works on image batch block k·q + i of d·q.

``split_batch_2p5d(x, mesh)``: images (or any tensor) replicated on every rank → my batch block
k·q + i. Backward: rank (k, i, j) fed the block to its hidden part j, so ∂L/∂X[block k·q + i] is
the sum over my grid row (all-reduce on ``row``), and the whole ∂L/∂X the blocks in order
(all-gather on ``depth_col``, whose member k·q + i holds block k·q + i). With d = 1 it is
:func:`gridshard.comm.grid_ops.split_batch` on the grid (bit for bit).

``classification_loss_2p5d``: every rank of grid row i in layer k holds the full logits of its
block [b/(d·q), K] (the 2D heads' output); the loss sums ℓ over the block and then over the d·q
blocks with ``reduce_from_group`` on ``depth_col`` (forward all-reduce of one number, backward
identity: each rank backpropagates its own block, every rank holds the same total); the mean
divides by the labels ≠ ``ignore_index`` counted the same way (NaN with zero gradient when none).
2D's :func:`gridshard.nn.classification_loss.classification_loss` with ``col`` → ``depth_col``; with
d = 1 that function itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.depth_ops import reduce_grads_over_depth
from ..comm.dual_ops import reduce_from_group
from ..comm.grid_ops import split_batch
from ..errors import ShapeError, check_divisible
from .classification_loss import classification_loss
from .classifier_2d import Classifier2D, ClsClassifier2D
from .patch_embedding_2d import PatchEmbedding2D


class _SplitBatch2p5D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return x.chunk(mesh.d * mesh.q, dim)[mesh.batch_index].contiguous()

    @staticmethod
    def backward(ctx, g):
        g = C.all_reduce(g, ctx.mesh.row)
        return C.all_gather(g, ctx.mesh.depth_col, ctx.dim), None, None


def split_batch_2p5d(x: torch.Tensor, mesh, dim: int = 0) -> torch.Tensor:
    """Keep batch block k·q + i of a tensor replicated on every rank (module docstring);
    ShapeError before any collective when the batch is not a multiple of d·q."""
    if mesh.d == 1:
        return split_batch(x, mesh.grid, dim)
    check_divisible(x.shape[dim], mesh.d * mesh.q, "batch", "d·q (the 2.5D batch blocks)",
                    f"use a batch that is a multiple of d·q = {mesh.d * mesh.q}")
    return _SplitBatch2p5D.apply(x, mesh, dim)


class PatchEmbedding2p5D(PatchEmbedding2D):
    """Images [b/(d·q), C, H, W] → [b/(d·q), 1 + n, h/q]; the 2D layer on ``mesh.grid``."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, hidden: int, mesh, init_std: float = 0.02,
                 **kwargs):
        super().__init__(img_size, patch_size, in_chans, hidden, mesh.grid, init_std, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)


class Classifier2p5D(Classifier2D):
    """Few-class head [b/(d·q), …, h/q] → full logits [b/(d·q), …, C]; the 2D head on ``mesh.grid``."""

    def __init__(self, in_features: int, num_classes: int, mesh, **kwargs):
        super().__init__(in_features, num_classes, mesh.grid, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)


class ClsClassifier2p5D(ClsClassifier2D):
    """The ViT head (class token's row) in 2.5D; the 2D head on ``mesh.grid``."""

    def __init__(self, in_features: int, num_classes: int, mesh, **kwargs):
        super().__init__(in_features, num_classes, mesh.grid, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)


def classification_loss_2p5d(logits: torch.Tensor, labels: torch.Tensor, mesh, ignore_index: int = -100,
                             reduction: str = "mean") -> torch.Tensor:
    """The loss of the micro-batch's d·q blocks, the same scalar on every rank (module docstring)."""
    if mesh.d == 1:
        return classification_loss(logits, labels, mesh.grid.col, ignore_index, reduction)
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ShapeError(f"classification_loss_2p5d: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         f"disagree: logits must be [b, classes] and labels [b]. Fix: pass this rank's labels "
                         f"(batch block {mesh.batch_index}, mesh.batch_block(labels, hidden=False)).")
    total = reduce_from_group(F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum"),
                              mesh.depth_col)
    if reduction == "sum":
        return total
    with torch.no_grad():
        count = C.all_reduce((labels != ignore_index).sum().reshape(1).double(), mesh.depth_col, inplace=True)[0]
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
