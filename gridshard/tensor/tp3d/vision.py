"""The ViT path on a 3D cube (T = q³): patch embedding, few-class classifier, classification loss.

Layout (a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation; rank (i, j, l) = weight, input,
output coordinates): activations [b, s, h] are held as [b/q², s, h/q], batch block
``mesh.batch_index`` = i·q + j and hidden block ``mesh.hidden_index`` = l; images and labels are
data, every rank slices its batch block itself (``mesh.batch_block(x, hidden=False)``).

``PatchEmbedding3D``: images [b/q², C, H, W] → tokens [b/q², 1 + n, h/q] (n = (H/P)² patches of
P×P pixels, K = C·P² numbers each). Parameters as PatchEmbedding2D's (global, drawn in this order
from the default RNG): ``weight`` [h, C, P, P] ~ N(0, init_std²), ``bias`` [h] zeros, ``cls_token``
[1, 1, h] and ``pos_embed`` [1, 1 + n, h] ~ N(0, init_std²). Each is cut on its hidden dim like a
3D vector (:func:`gridshard.tensor.tp3d.linear.hidden_cut_3d`): hidden block l, then sub-block i·q + j
(the member index of ``mesh.batch``), h/q³ channels per rank, so every rank stores 1/q³ of the
layer. Forward all-gathers the four over ``mesh.batch`` (q² ranks) to hidden block l, runs the
convolution locally on my batch block with the output channels of block l, prepends the class
token and adds the positions: the result is already my block of the activation layout, no
activation moves. Backward reduce-scatters the four gradients over ``batch`` (summing the q²
batch blocks, every image of the micro-batch once).

Why gather the kernel rather than run the convolution as a Linear3D over flattened patches: both
store 1/q³ of the parameters, but per rank and forward + backward (payload; ring wire bytes are
(m − 1)/m of it on an axis of m ranks)

    gather-then-local:  2·(K + 2 + s)·h/q · e           on ``batch`` (q² ranks), independent of the batch
    Linear3D:           (2·N·K + 2·K·h + 2·N·h)/q² · e  on q-rank axes (N = b·n tokens, no input gradient)

so in wire bytes the first is smaller once q·K·h < N·(K + h) (the bias, class token and positions
aside), i.e. N > q·h/2 tokens when K = h: for ViT-B/16 (K = h = 768) at q = 2 from four images of
196 patches on, and it grows with nothing but the model while Linear3D's grows with the batch. It
also needs no second orientation: the tokens come out in ``mesh``'s own layout, and its weight
gathers depend on no activation (they could be issued early). Images that require a gradient get it
whole: the convolution on my batch block sees hidden block l only, so ∂L/∂images is summed over
``mesh.output`` (``copy_to_group``: an all-reduce of b/q²·C·H·W·e in backward, nothing for data).

``Classifier3D`` (few classes K, full logits per rank as the 2D head): input [b/q², …, h/q]; weight
[K, h] cut on h like a vector, [K, h/q³] per rank; bias [K] replicated:

    forward:  W_l = all-gather_batch(W) [K, h/q]; logits = all-reduce_output(x·W_lᵀ) + b
              → the full logits [b/q², …, K] of batch block i·q + j, alike on the q ranks of
              ``output``;
    backward: the output all-reduce's dual is identity (every rank of ``output`` holds the same
              logits and upstream gradient); dW_l reduce-scattered over ``batch`` (the q² batch
              blocks summed); the bias gradient all-reduced over ``batch`` (``copy_to_group``).

``ClsClassifier3D``: Classifier3D on the class token's row of [b/q², s, h/q] (the ViT head).
``ViTEmbeddings3D``: PatchEmbedding3D under Hugging Face's ``ViTEmbeddings`` names, what
:func:`gridshard.parallelize` builds for a ViT at 3D (with LayerNorm3D, Linear3D and ClsClassifier3D
on the residual orientation: the logits, and so the labels, are in the images' batch block).

``classification_loss_3d``: every rank holds the full logits [b/q², K] of its batch block and
its labels [b/q²] (−100 = ignored); Σ ℓ over the block, then over the q² blocks with
``reduce_from_group`` on ``batch`` (forward all-reduce of one fp32 number, backward identity);
"mean" divides by the valid labels counted the same way (one all-reduce of one float64, no
gradient; NaN with zero gradient when none is valid, as ``F.cross_entropy``). The same scalar on
every rank of the cube.

Communication: :func:`gridshard.tensor.tp3d.theory.patch_embedding3d_comm`,
:func:`gridshard.tensor.tp3d.theory.classifier3d_comm`, :func:`gridshard.tensor.tp3d.theory.classification_loss3d_comm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...comm import collectives as C
from ...comm.dual_ops import reduce_from_group
from ...errors import ShapeError
from ..grid_vision import ClsHead, GridClassifier, GridPatchEmbedding, GridViTEmbeddings
from ..tp2d.cross_entropy import REDUCTIONS
from .linear import hidden_cut_3d


class PatchEmbedding3D(GridPatchEmbedding):
    """Conv patch embedding + class token + positions on ``mesh`` (module docstring)."""

    hidden_cut = staticmethod(hidden_cut_3d)


class ViTEmbeddings3D(GridViTEmbeddings):
    """PatchEmbedding3D under Hugging Face ``ViTEmbeddings`` names, the 3D layer of
    :class:`gridshard.models.vit.ViTEmbeddings`; its tokens are in ``mesh``'s layout (the residual
    stream's orientation)."""

    hidden_cut = staticmethod(hidden_cut_3d)


class Classifier3D(GridClassifier):
    """Few-class head: [b/q², …, h/q] → full logits [b/q², …, K] of my batch block (module docstring)."""

    hidden_cut = staticmethod(hidden_cut_3d)


class ClsClassifier3D(ClsHead, Classifier3D):
    """The ViT head in 3D: the class token's row of my final hidden block [b/q², s, h/q] (the
    sequence is whole in 3D) → logits [b/q², K] of batch block ``mesh.batch_index``."""


def classification_loss_3d(logits: torch.Tensor, labels: torch.Tensor, mesh, ignore_index: int = -100,
                           reduction: str = "mean") -> torch.Tensor:
    """The loss of the cube's micro-batch (its q² batch blocks), the same scalar on every rank
    (module docstring). ``mesh``: the orientation of the classifier that gave ``logits``."""
    if reduction not in REDUCTIONS:
        raise ShapeError(f"classification_loss_3d: reduction={reduction!r} is not one of {REDUCTIONS}. Fix: use "
                         f"'mean' or 'sum'.")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ShapeError(f"classification_loss_3d: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         f"disagree: logits must be [b/q², classes] and labels [b/q²]. Fix: pass this rank's labels "
                         f"(batch block {mesh.batch_index}, mesh.batch_block(labels, hidden=False)).")
    total = reduce_from_group(F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum"),
                              mesh.batch)
    if reduction == "sum":
        return total
    with torch.no_grad():
        count = C.all_reduce((labels != ignore_index).sum().reshape(1).double(), mesh.batch, inplace=True)[0]
    mean = total / count.clamp(min=1).to(total.dtype)       # finite upstream weight: zero grads at N = 0
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
