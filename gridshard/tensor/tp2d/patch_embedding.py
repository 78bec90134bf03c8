"""PatchEmbedding2D (ViT): images → [b/q, 1 + n_patches, h/q] at rank (i, j).

Input: this rank's images [b/q, C, H, W] (batch block i, e.g. from
:func:`gridshard.comm.grid_ops.split_batch`). Patches of P×P pixels, n = (H/P)·(W/P).

Parameters (global, drawn in this order from the default RNG):

* ``weight`` [h, C, P, P] ~ N(0, init_std²) (a linear map of a flattened patch,
  out = h first), ``bias`` [h] zeros;
* ``cls_token`` [1, 1, h] ~ N(0, init_std²), ``pos_embed`` [1, 1 + n, h] ~ N(0, init_std²).

Each is split on its hidden dim like a Linear2D bias: rank (i, j) stores sub-block i
of hidden block j (h/q² channels), and all-gathers along the column to hidden block j
(h/q channels) in forward; backward reduce-scatters the gradients along the column
(summing the q batch blocks). The convolution then runs locally on the batch block
with the output channels of hidden block j: no rank holds the full kernel.

Output: [cls, patch_1 … patch_n] + pos, block [b/q, 1 + n, h/q].

:class:`ViTEmbeddings2D` is the same layer (:func:`patch_embed_2d`) under Hugging Face's
``ViTEmbeddings`` parameter names, what :func:`gridshard.parallelize` builds for a ViT in 2D.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.grid_ops import gather_along
from ...errors import ShapeError, check_divisible
from ...nn.sharding import ShardSpec, sharded_parameter


def _hidden_split(shape, dim) -> ShardSpec:
    return ShardSpec(tuple(shape), ((dim, "grid_col"), (dim, "grid_row")))


class PatchEmbedding2D(nn.Module):
    """Conv patch embedding + class token + position embedding (see module docstring)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, hidden: int, mesh, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        q = mesh.q
        check_divisible(img_size, patch_size, "img_size", "patch_size")
        check_divisible(hidden, q * q, "hidden (patch embedding splits it into q² blocks)", "q²",
                        f"use hidden a multiple of {q * q}")
        self.mesh, self.img_size, self.patch_size, self.in_chans, self.hidden = mesh, img_size, patch_size, \
            in_chans, hidden
        self.num_patches = (img_size // patch_size) ** 2
        normal = lambda full: full.normal_(0.0, init_std)  # noqa: E731
        self.weight = sharded_parameter(_hidden_split((hidden, in_chans, patch_size, patch_size), 0), mesh,
                                        normal, dtype)
        self.bias = sharded_parameter(_hidden_split((hidden,), 0), mesh, nn.init.zeros_, dtype)
        self.cls_token = sharded_parameter(_hidden_split((1, 1, hidden), 2), mesh, normal, dtype)
        self.pos_embed = sharded_parameter(_hidden_split((1, 1 + self.num_patches, hidden), 2), mesh, normal, dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return patch_embed_2d(images, self.weight, self.bias, self.cls_token, self.pos_embed, self.mesh,
                              self.patch_size, (self.in_chans, self.img_size))


def patch_embed_2d(images, weight, bias, cls_token, positions, mesh, patch_size: int, image: tuple) -> torch.Tensor:
    """This rank's [b/q, 1 + n, h/q] block from its images [b/q, C, H, W] and the four h/q²
    shards (module docstring); ``image`` = (C, H) checks the input."""
    chans, size = image
    if images.dim() != 4 or tuple(images.shape[1:]) != (chans, size, size):
        raise ShapeError(f"PatchEmbedding2D expects images [b/q, {chans}, {size}, {size}], got "
                         f"{tuple(images.shape)}. Fix: pass this rank's batch block (split_batch) of correctly "
                         f"sized images.")
    col = mesh.col
    w, b = gather_along(weight, col, 0), gather_along(bias, col, 0)
    y = F.conv2d(images, w.to(images.dtype), b.to(images.dtype), stride=patch_size).flatten(2).transpose(1, 2)
    cls = gather_along(cls_token, col, 2).expand(y.shape[0], -1, -1).to(y.dtype)
    return torch.cat([cls, y], dim=1) + gather_along(positions, col, 2).to(y.dtype)


class _Projection(nn.Module):
    """The convolution's weight [h, C, P, P] and bias [h], 2D-split on h (``patch_embeddings.projection``)."""

    def __init__(self, hidden: int, chans: int, patch: int, mesh, dtype, device):
        super().__init__()
        self.weight = sharded_parameter(_hidden_split((hidden, chans, patch, patch), 0), mesh,
                                        nn.init.zeros_, dtype, device)
        self.bias = sharded_parameter(_hidden_split((hidden,), 0), mesh, nn.init.zeros_, dtype, device)


class _PatchEmbeddings(nn.Module):
    def __init__(self, projection: _Projection):
        super().__init__()
        self.projection = projection


class ViTEmbeddings2D(nn.Module):
    """PatchEmbedding2D under Hugging Face ``ViTEmbeddings`` names (``cls_token``,
    ``position_embeddings``, ``patch_embeddings.projection.weight | bias``), the 2D layer of
    :class:`gridshard.models.vit.ViTEmbeddings`; built by :func:`gridshard.parallelize` on the meta
    device (values from the initialisation laws), or with zeros elsewhere."""

    def __init__(self, image_size: int, patch_size: int, channels: int, hidden: int, mesh,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        q = mesh.q
        check_divisible(image_size, patch_size, "image_size", "patch_size")
        check_divisible(hidden, q * q, "hidden (patch embedding splits it into q² blocks)", "q²",
                        f"use hidden a multiple of {q * q}")
        self.mesh, self.image_size, self.patch_size, self.channels = mesh, image_size, patch_size, channels
        n = (image_size // patch_size) ** 2
        self.cls_token = sharded_parameter(_hidden_split((1, 1, hidden), 2), mesh, nn.init.zeros_, dtype, device)
        self.patch_embeddings = _PatchEmbeddings(_Projection(hidden, channels, patch_size, mesh, dtype, device))
        self.position_embeddings = sharded_parameter(_hidden_split((1, 1 + n, hidden), 2), mesh, nn.init.zeros_,
                                                     dtype, device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        proj = self.patch_embeddings.projection
        return patch_embed_2d(images, proj.weight, proj.bias, self.cls_token, self.position_embeddings, self.mesh,
                              self.patch_size, (self.channels, self.image_size))
