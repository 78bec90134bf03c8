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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.grid_ops import gather_along
from ..errors import ShapeError, check_divisible
from .sharding import ShardSpec, sharded_parameter


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
        if images.dim() != 4 or tuple(images.shape[1:]) != (self.in_chans, self.img_size, self.img_size):
            raise ShapeError(f"PatchEmbedding2D expects images [b/q, {self.in_chans}, {self.img_size}, "
                             f"{self.img_size}], got {tuple(images.shape)}. Fix: pass this rank's batch block "
                             f"(split_batch) of correctly sized images.")
        col = self.mesh.col
        w, b = gather_along(self.weight, col, 0), gather_along(self.bias, col, 0)
        y = F.conv2d(images, w, b, stride=self.patch_size).flatten(2).transpose(1, 2)  # [b/q, n, h/q]
        cls = gather_along(self.cls_token, col, 2).expand(y.shape[0], -1, -1)
        return torch.cat([cls, y], dim=1) + gather_along(self.pos_embed, col, 2)
