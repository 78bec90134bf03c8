"""The ViT layers of the 2D grid and the 3D cube, written once over the mode's hidden cut.

Each class here reads its mesh through :attr:`hidden_cut` (:class:`gridshard.tensor.hidden_cut.HiddenCut`,
set by the 2D and 3D subclasses: :mod:`gridshard.tensor.tp2d.patch_embedding`,
:mod:`gridshard.tensor.tp2d.classifier`, :mod:`gridshard.tensor.tp3d.vision`, whose docstrings carry the
math and the bytes moved). With G the ``gather`` axis (2D: the grid column; 3D: ``batch``) and R the
``reduce`` axis (2D: the grid row; 3D: ``output``):

* patch embedding: kernel [h, C, P, P], bias [h], class token [1, 1, h] and positions [1, 1 + n, h],
  each cut on h (1/q² or 1/q³ per rank), all-gathered over G to my hidden block, the convolution run
  locally on my batch block; images that require a gradient get it summed over R (3D here; 2D's
  ``split_batch`` sums it in its backward);
* classifier (few classes K): weight [K, h] cut on h, gathered over G; the partial logits all-reduced
  over R (backward identity), the replicated bias's gradient all-reduced over G.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.dual_ops import copy_to_group, reduce_from_group
from ..comm.grid_ops import gather_along
from ..errors import ShapeError, check_divisible
from ..nn.sharding import ShardSpec
from .hidden_cut import HiddenCut, normal_init


class _GridLayer(nn.Module):
    """The subclass sets ``hidden_cut`` (mesh → :class:`HiddenCut`)."""

    hidden_cut: Callable[[object], HiddenCut]

    def _hidden_param(self, shape, dim: int, init, dtype, device) -> nn.Parameter:
        return self.cut.parameter(self.cut.spec(shape, dim), init, dtype, device)


def patch_embed(images, weight, bias, cls_token, positions, cut: HiddenCut, patch_size: int, image: tuple,
                name: str) -> torch.Tensor:
    """My [rows, 1 + n, h/q] block from my images [rows, C, H, W] and the four hidden-cut shards
    (module docstring); ``image`` = (C, H) checks the input before any collective."""
    chans, size = image
    if images.dim() != 4 or tuple(images.shape[1:]) != (chans, size, size):
        raise ShapeError(f"{name} expects images [{cut.rows}, {chans}, {size}, {size}], got "
                         f"{tuple(images.shape)}. Fix: pass this rank's batch block ({cut.batch_fix}) of correctly "
                         f"sized images.")
    if images.requires_grad and cut.sum_image_grad:
        images = copy_to_group(images, cut.reduce)        # ∂L/∂images summed over the q hidden blocks
    w, b = gather_along(weight, cut.gather, 0), gather_along(bias, cut.gather, 0)
    y = F.conv2d(images, w.to(images.dtype), b.to(images.dtype), stride=patch_size).flatten(2).transpose(1, 2)
    cls = gather_along(cls_token, cut.gather, 2).expand(y.shape[0], -1, -1).to(y.dtype)
    return torch.cat([cls, y], dim=1) + gather_along(positions, cut.gather, 2).to(y.dtype)


class GridPatchEmbedding(_GridLayer):
    """Conv patch embedding + class token + position embedding (module docstring)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, hidden: int, mesh, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cut = self.hidden_cut(mesh)
        check_divisible(img_size, patch_size, "img_size", "patch_size")
        self.cut.check(hidden, "hidden", "the patch embedding")
        self.mesh, self.img_size, self.patch_size, self.in_chans, self.hidden = mesh, img_size, patch_size, \
            in_chans, hidden
        self.num_patches = (img_size // patch_size) ** 2
        normal = normal_init(init_std)
        self.weight = self._hidden_param((hidden, in_chans, patch_size, patch_size), 0, normal, dtype, device)
        self.bias = self._hidden_param((hidden,), 0, nn.init.zeros_, dtype, device)
        self.cls_token = self._hidden_param((1, 1, hidden), 2, normal, dtype, device)
        self.pos_embed = self._hidden_param((1, 1 + self.num_patches, hidden), 2, normal, dtype, device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return patch_embed(images, self.weight, self.bias, self.cls_token, self.pos_embed, self.cut,
                           self.patch_size, (self.in_chans, self.img_size), type(self).__name__)

    def extra_repr(self) -> str:
        return (f"img={self.img_size}, patch={self.patch_size}, chans={self.in_chans}, hidden={self.hidden}, "
                f"q={self.mesh.q}{self.cut.tag}")


class _PatchEmbeddings(nn.Module):
    """``patch_embeddings.projection``: the convolution's weight [h, C, P, P] and bias [h], cut on h."""

    def __init__(self, layer: _GridLayer, hidden: int, chans: int, patch: int, dtype, device):
        super().__init__()
        self.projection = nn.Module()
        self.projection.weight = layer._hidden_param((hidden, chans, patch, patch), 0, nn.init.zeros_, dtype, device)
        self.projection.bias = layer._hidden_param((hidden,), 0, nn.init.zeros_, dtype, device)


class GridViTEmbeddings(_GridLayer):
    """The patch embedding under Hugging Face ``ViTEmbeddings`` names (``cls_token``,
    ``position_embeddings``, ``patch_embeddings.projection.weight | bias``), the layer of
    :class:`gridshard.models.vit.ViTEmbeddings` that :func:`gridshard.parallelize` builds on the meta
    device (values from the initialisation laws), or with zeros elsewhere; its tokens are in
    ``mesh``'s activation layout."""

    def __init__(self, image_size: int, patch_size: int, channels: int, hidden: int, mesh,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cut = self.hidden_cut(mesh)
        check_divisible(image_size, patch_size, "image_size", "patch_size")
        self.cut.check(hidden, "hidden", "the patch embedding")
        self.mesh, self.image_size, self.patch_size, self.channels = mesh, image_size, patch_size, channels
        n = (image_size // patch_size) ** 2
        self.cls_token = self._hidden_param((1, 1, hidden), 2, nn.init.zeros_, dtype, device)
        self.patch_embeddings = _PatchEmbeddings(self, hidden, channels, patch_size, dtype, device)
        self.position_embeddings = self._hidden_param((1, 1 + n, hidden), 2, nn.init.zeros_, dtype, device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        proj = self.patch_embeddings.projection
        return patch_embed(images, proj.weight, proj.bias, self.cls_token, self.position_embeddings, self.cut,
                           self.patch_size, (self.channels, self.image_size), type(self).__name__)


class GridClassifier(_GridLayer):
    """Few-class head: [rows, …, h/q] → the full logits [rows, …, K] of my batch block, alike on the
    q ranks of ``reduce`` (module docstring)."""

    def __init__(self, in_features: int, num_classes: int, mesh, bias: bool = True, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cut = self.hidden_cut(mesh)
        self.cut.check(in_features, "in_features", type(self).__name__)
        self.mesh, self.in_features, self.num_classes = mesh, in_features, num_classes
        self.in_local = in_features // mesh.q
        self.weight = self._hidden_param((num_classes, in_features), 1, normal_init(init_std), dtype, device)
        if bias:
            self.bias = self.cut.parameter(ShardSpec((num_classes,)), nn.init.zeros_, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_local:
            raise ShapeError(f"{type(self).__name__}({self.in_features}→{self.num_classes}) got a local input with "
                             f"last dim {x.shape[-1]}: on a q={self.mesh.q} {self.cut.shape} each rank holds in/q = "
                             f"{self.in_local}. Fix: pass this rank's [{self.cut.rows}, …, h/q] block, on the mesh "
                             f"(orientation) the head was built on.")
        w = gather_along(self.weight, self.cut.gather, 1)                  # [K, h/q], my hidden block
        logits = reduce_from_group(x @ w.t().to(x.dtype), self.cut.reduce)
        if self.bias is not None:
            logits = logits + copy_to_group(self.bias, self.cut.gather).to(logits.dtype)
        return logits

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, classes={self.num_classes}, q={self.mesh.q}, bias={self.bias is not None}"
                f"{self.cut.tag}")


class ClsHead:
    """The ViT head (:class:`gridshard.models.vit.ClsClassifier`), mixed in before a grid classifier: the
    class token's row of my final hidden block [rows, s, h/q] (the sequence is whole in 2D and 3D) →
    the logits [rows, K] of my batch block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ShapeError(f"{type(self).__name__} expects hidden states [{self.cut.rows}, s, h/q], got "
                             f"{tuple(x.shape)}. Fix: pass the final layer norm's output block.")
        return super().forward(x[:, 0])
