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

:class:`ViTEmbeddings2D` is the same layer under Hugging Face's ``ViTEmbeddings`` parameter names,
what :func:`gridshard.parallelize` builds for a ViT in 2D. Both are the shared
:mod:`gridshard.tensor.grid_vision` layers on the grid's hidden cut (``gather`` = the column). The
images' gradient is summed over the q hidden blocks by :func:`~gridshard.comm.grid_ops.split_batch`'s
backward.
"""
from __future__ import annotations

from ..grid_vision import GridPatchEmbedding, GridViTEmbeddings
from .linear import hidden_cut_2d


class PatchEmbedding2D(GridPatchEmbedding):
    """Conv patch embedding + class token + position embedding (see module docstring)."""

    hidden_cut = staticmethod(hidden_cut_2d)


class ViTEmbeddings2D(GridViTEmbeddings):
    """PatchEmbedding2D under Hugging Face ``ViTEmbeddings`` names (``cls_token``,
    ``position_embeddings``, ``patch_embeddings.projection.weight | bias``), the 2D layer of
    :class:`gridshard.models.vit.ViTEmbeddings`; built by :func:`gridshard.parallelize` on the meta
    device (values from the initialisation laws), or with zeros elsewhere."""

    hidden_cut = staticmethod(hidden_cut_2d)
