"""Where a laid-out parameter's block sits in the canonical tensor, in the terms of PyTorch
components that speak DTensor (``torch.distributed.checkpoint``, FSDP2): its DTensor
placements (:func:`placements_of`). Its box of offsets in the canonical tensor, which the
checkpoint writes, is :meth:`gridshard.nn.sharding.ShardSpec.canonical_box`.

A parameter's :class:`ShardSpec` becomes DTensor placements on the job's tensor sub-mesh
(1D: ``device_mesh["tensor"]``; 2D: ``device_mesh["grid_row", "grid_col"]``) whenever
its block is one DTensor chunk of the *canonical* tensor:

===========================  =====================================  ==========================
parameter                    spec (storage)                         placements → local view
===========================  =====================================  ==========================
replicated (norms, 1D)       no split                               Replicate()
column / row / vocab (1D)    (d, tensor)                            Shard(d)
vocab table, padded rows     (0, tensor), canonical V < V_p          Shard(0); local[:rows], the
                                                                    rows torch.chunk gives it
Linear2D weight [in, out]    (0, grid_row), (1, grid_col), ᵀ        (Shard(1), Shard(0)); local.t()
2D vocab table [V_p, h]      (0, grid_row), (1, grid_col)           (Shard(0), Shard(1))
2D vocab head [h, V_p]       (0, grid_row), (1, grid_col), ᵀ        (Shard(1), Shard(0)); local.t()
===========================  =====================================  ==========================

Not expressible as standard placements (returned as ``None``): 2D norm / bias vectors
(q² sub-blocks ordered column-major) and kv blocks replicated in groups of T/kv. Those
are still plain offset blocks of the canonical tensor (``ShardSpec.canonical_box``), which is
all a checkpoint planner needs.

The views themselves (``DTensor.from_local`` over each block, sharing its storage) are
built by :mod:`gridshard.testing.dtensor_views`: only tests read them today.
"""
from __future__ import annotations

from typing import Optional

from torch.distributed.tensor import Replicate, Shard

from ..nn.sharding import ShardSpec


def placements_of(spec: ShardSpec, mesh) -> Optional[tuple]:
    """DTensor placements of the canonical tensor on the tensor dims of the device mesh
    (:func:`tensor_dim_names`: ``tensor`` in 1D, ``(grid_row, grid_col)`` in 2D), or None: a block
    split twice by one coordinate, or one dim split by two."""
    if spec.replicate > 1:
        return None
    names = tensor_dim_names(mesh)
    by_coord = {}                                     # coordinate → the canonical dim it splits
    for d, coord in spec.splits:
        if coord in by_coord or coord not in names:
            return None
        by_coord[coord] = len(spec.global_shape) - 1 - d if spec.transposed else d
    if len(set(by_coord.values())) != len(by_coord):
        return None                                   # two coords on one dim: not mesh-ordered
    return tuple(Shard(by_coord[c]) if c in by_coord else Replicate() for c in names)


def tensor_dim_names(mesh) -> tuple:
    """The device-mesh dims the tensor group is laid out on (the scheme's ``tensor_dims``):
    ``("tensor",)`` in 1D, ``("grid_row", "grid_col")`` in 2D, the cube's three in 3D."""
    return tuple(name for name, _ in mesh.tensor_mode.tensor_dims(mesh.tensor.size))
