"""The ViT path on a 3D cube (T = q³): patch embedding, few-class classifier, classification loss.

Layout (a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation; rank (i, j, l) = weight, input,
output coordinates): activations [b, s, h] are held as [b/q², s, h/q], batch block
``mesh.batch_index`` = i·q + j and hidden block ``mesh.hidden_index`` = l; images and labels are
data, every rank slices its batch block itself (``mesh.batch_block(x, hidden=False)``).

``PatchEmbedding3D``: images [b/q², C, H, W] → tokens [b/q², 1 + n, h/q] (n = (H/P)² patches of
P×P pixels, K = C·P² numbers each). Parameters as PatchEmbedding2D's (global, drawn in this order
from the default RNG): ``weight`` [h, C, P, P] ~ N(0, init_std²), ``bias`` [h] zeros, ``cls_token``
[1, 1, h] and ``pos_embed`` [1, 1 + n, h] ~ N(0, init_std²). Each is cut on its hidden dim like a
3D vector (:func:`gridshard.tensor.tp3d.linear.vector_spec_3d`): hidden block l, then sub-block i·q + j
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
from torch import nn

from ...comm import collectives as C
from ...comm.dual_ops import copy_to_group, reduce_from_group
from ...comm.grid_ops import gather_along
from ...errors import ShapeError, check_divisible
from ..tp2d.cross_entropy import REDUCTIONS
from .linear import sharded_parameter_3d
from ...nn.sharding import ShardSpec


def hidden_spec_3d(shape: tuple, dim: int, mesh) -> ShardSpec:
    """A tensor cut on its hidden dim ``dim`` as a 3D vector: hidden block = ``mesh``'s output
    coordinate, then sub-block weight·q + input (= ``mesh.batch`` member order): 1/q³ per rank."""
    return ShardSpec(tuple(shape), ((dim, mesh.output.name), (dim, "weight"), (dim, mesh.input.name)))


def _check_hidden(hidden: int, q: int, what: str) -> None:
    check_divisible(hidden, q ** 3, f"{what} (3D vision layers split it into q³ blocks)", "q³",
                    f"use a multiple of {q ** 3}")


class PatchEmbedding3D(nn.Module):
    """Conv patch embedding + class token + positions on ``mesh`` (module docstring)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, hidden: int, mesh, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        check_divisible(img_size, patch_size, "img_size", "patch_size")
        _check_hidden(hidden, mesh.q, "hidden")
        self.mesh, self.img_size, self.patch_size, self.in_chans, self.hidden = mesh, img_size, patch_size, \
            in_chans, hidden
        self.num_patches = (img_size // patch_size) ** 2
        normal = lambda full: full.normal_(0.0, init_std)  # noqa: E731

        def param(shape, dim, init):
            return sharded_parameter_3d(hidden_spec_3d(shape, dim, mesh), mesh, init, dtype, device)

        self.weight = param((hidden, in_chans, patch_size, patch_size), 0, normal)
        self.bias = param((hidden,), 0, nn.init.zeros_)
        self.cls_token = param((1, 1, hidden), 2, normal)
        self.pos_embed = param((1, 1 + self.num_patches, hidden), 2, normal)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return patch_embed_3d(images, self.weight, self.bias, self.cls_token, self.pos_embed, self.mesh,
                              self.patch_size, (self.in_chans, self.img_size))

    def extra_repr(self) -> str:
        return (f"img={self.img_size}, patch={self.patch_size}, chans={self.in_chans}, hidden={self.hidden}, "
                f"q={self.mesh.q}{', swapped' if self.mesh.is_swapped else ''}")


def patch_embed_3d(images, weight, bias, cls_token, positions, mesh, patch_size: int, image: tuple) -> torch.Tensor:
    """My [b/q², 1 + n, h/q] block from my images [b/q², C, H, W] and the four h/q³ shards (module
    docstring); ``image`` = (C, H) checks the input before any collective."""
    chans, size = image
    if images.dim() != 4 or tuple(images.shape[1:]) != (chans, size, size):
        raise ShapeError(f"PatchEmbedding3D expects images [b/q², {chans}, {size}, {size}], got "
                         f"{tuple(images.shape)}. Fix: pass this rank's batch block "
                         f"(mesh.batch_block(images, hidden=False)) of correctly sized images.")
    batch = mesh.batch
    if images.requires_grad:
        images = copy_to_group(images, mesh.output)       # ∂L/∂images summed over the q hidden blocks
    w, b = gather_along(weight, batch, 0), gather_along(bias, batch, 0)
    y = F.conv2d(images, w.to(images.dtype), b.to(images.dtype), stride=patch_size).flatten(2).transpose(1, 2)
    cls = gather_along(cls_token, batch, 2).expand(y.shape[0], -1, -1).to(y.dtype)
    return torch.cat([cls, y], dim=1) + gather_along(positions, batch, 2).to(y.dtype)


class _Projection(nn.Module):
    """The convolution's weight [h, C, P, P] and bias [h], cut on h as 3D vectors (``patch_embeddings.projection``)."""

    def __init__(self, hidden: int, chans: int, patch: int, mesh, dtype, device):
        super().__init__()
        self.weight = sharded_parameter_3d(hidden_spec_3d((hidden, chans, patch, patch), 0, mesh), mesh,
                                           nn.init.zeros_, dtype, device)
        self.bias = sharded_parameter_3d(hidden_spec_3d((hidden,), 0, mesh), mesh, nn.init.zeros_, dtype, device)


class _PatchEmbeddings(nn.Module):
    def __init__(self, projection: _Projection):
        super().__init__()
        self.projection = projection


class ViTEmbeddings3D(nn.Module):
    """PatchEmbedding3D under Hugging Face ``ViTEmbeddings`` names (``cls_token``,
    ``position_embeddings``, ``patch_embeddings.projection.weight | bias``), the 3D layer of
    :class:`gridshard.models.vit.ViTEmbeddings` that :func:`gridshard.parallelize` builds on the meta
    device (values from the initialisation laws), or with zeros elsewhere; its tokens are in
    ``mesh``'s layout (the residual stream's orientation)."""

    def __init__(self, image_size: int, patch_size: int, channels: int, hidden: int, mesh,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        check_divisible(image_size, patch_size, "image_size", "patch_size")
        _check_hidden(hidden, mesh.q, "hidden")
        self.mesh, self.image_size, self.patch_size, self.channels = mesh, image_size, patch_size, channels
        n = (image_size // patch_size) ** 2
        self.cls_token = sharded_parameter_3d(hidden_spec_3d((1, 1, hidden), 2, mesh), mesh, nn.init.zeros_, dtype,
                                              device)
        self.patch_embeddings = _PatchEmbeddings(_Projection(hidden, channels, patch_size, mesh, dtype, device))
        self.position_embeddings = sharded_parameter_3d(hidden_spec_3d((1, 1 + n, hidden), 2, mesh), mesh,
                                                        nn.init.zeros_, dtype, device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        proj = self.patch_embeddings.projection
        return patch_embed_3d(images, proj.weight, proj.bias, self.cls_token, self.position_embeddings, self.mesh,
                              self.patch_size, (self.channels, self.image_size))


class Classifier3D(nn.Module):
    """Few-class head: [b/q², …, h/q] → full logits [b/q², …, K] of my batch block (module docstring)."""

    def __init__(self, in_features: int, num_classes: int, mesh, bias: bool = True, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        _check_hidden(in_features, mesh.q, "in_features")
        self.mesh, self.in_features, self.num_classes = mesh, in_features, num_classes
        self.in_local = in_features // mesh.q
        self.weight = sharded_parameter_3d(hidden_spec_3d((num_classes, in_features), 1, mesh), mesh,
                                           lambda full: full.normal_(0.0, init_std), dtype, device)
        if bias:
            self.bias = sharded_parameter_3d(ShardSpec((num_classes,)), mesh, nn.init.zeros_, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_local:
            raise ShapeError(f"{type(self).__name__}({self.in_features}→{self.num_classes}) got a local input with "
                             f"last dim {x.shape[-1]}: on a q={self.mesh.q} cube each rank holds in/q = "
                             f"{self.in_local}. Fix: pass this rank's [b/q², …, h/q] block, on the orientation the "
                             f"head was built on.")
        w = gather_along(self.weight, self.mesh.batch, 1)                  # [K, h/q], hidden block l
        logits = reduce_from_group(x @ w.t().to(x.dtype), self.mesh.output)
        if self.bias is not None:
            logits = logits + copy_to_group(self.bias, self.mesh.batch).to(logits.dtype)
        return logits

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, classes={self.num_classes}, q={self.mesh.q}, bias={self.bias is not None}"
                f"{', swapped' if self.mesh.is_swapped else ''}")


class ClsClassifier3D(Classifier3D):
    """The ViT head in 3D: the class token's row of my final hidden block [b/q², s, h/q] (the
    sequence is whole in 3D) → logits [b/q², K] of batch block ``mesh.batch_index``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ShapeError(f"ClsClassifier3D expects hidden states [b/q², s, h/q], got {tuple(x.shape)}. Fix: pass "
                             f"the final layer norm's output block.")
        return super().forward(x[:, 0])


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
