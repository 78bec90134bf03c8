"""Shard specs: which mesh coordinates split which tensor dims of a parameter.

Every sharded parameter carries a :class:`ShardSpec` (``param.shard_spec``).
Initialisation, tests, checkpoint resharding and parameter-byte accounting read
it; nothing else guesses a layout.

A spec is a global shape plus an ordered list of splits ``(tensor_dim, coord)``.
``coord`` names a mesh coordinate: ``"tensor"`` (1D tensor rank t of T),
``"grid_row"`` (row index i of q) or ``"grid_col"`` (column index j of q). Splits
apply in order, each narrowing the block left by the previous ones. Examples:

* column-parallel weight [out, in]: ``((0, "tensor"),)`` → rank t holds rows
  t·out/T … (t+1)·out/T.
* Linear2D weight [in, out]: ``((0, "grid_row"), (1, "grid_col"))`` → rank (i, j)
  holds W[i-th in-block, j-th out-block].
* Linear2D bias [out]: ``((0, "grid_col"), (0, "grid_row"))`` → rank (i, j) holds
  the i-th sub-block of the j-th out-block, out/q² elements.

``fused_parts = k`` (with ``fused_dim``) describes a fused weight such as
gate|up (k=2) or q|k|v (k=3): the global dim is k equal parts laid side by side
and each part is split separately, so rank t holds [part₀ block t, part₁ block t, …]
and the fused pieces of one head/neuron stay on one rank (Megatron's stride).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..errors import check_divisible


@dataclass(frozen=True)
class ShardSpec:
    global_shape: Tuple[int, ...]
    splits: Tuple[Tuple[int, str], ...] = ()
    fused_parts: int = 1
    fused_dim: int = 0
    # mesh axes over which each rank's contribution to this (replicated) parameter's
    # gradient is partial (e.g. a norm weight applied to sequence-sharded activations).
    # The layer itself sums it (it uses the parameter through ``copy_to_group``), so the
    # .grad after backward is already complete: this mark is informational and must not
    # trigger a second reduction.
    partial_grad_axes: Tuple[str, ...] = field(default=())

    def local_shape(self, sizes: dict) -> Tuple[int, ...]:
        shape = list(self.global_shape)
        for dim, coord in self.splits:
            check_divisible(shape[dim], sizes[coord] * (self.fused_parts if dim == self.fused_dim else 1),
                            f"dim {dim} of a parameter of shape {self.global_shape}", f"{coord} size")
            shape[dim] //= sizes[coord]
        return tuple(shape)


def mesh_coords(mesh) -> Tuple[dict, dict]:
    """(index, size) dicts of the coordinates a spec can name, for this rank of ``mesh``."""
    idx = {"tensor": mesh.tensor.rank}
    size = {"tensor": mesh.tensor.size}
    if getattr(mesh, "q", None):
        idx.update(grid_row=mesh.grid_row, grid_col=mesh.grid_col)
        size.update(grid_row=mesh.q, grid_col=mesh.q)
    return idx, size


def take_shard(full: torch.Tensor, spec: ShardSpec, index: dict, size: dict) -> torch.Tensor:
    """The block of ``full`` (global tensor) held by the rank at coordinates ``index``."""
    out = full
    for dim, coord in spec.splits:
        n, k = size[coord], index[coord]
        if dim == spec.fused_dim and spec.fused_parts > 1:
            parts = out.chunk(spec.fused_parts, dim=dim)
            out = torch.cat([p.chunk(n, dim=dim)[k] for p in parts], dim=dim)
        else:
            out = out.chunk(n, dim=dim)[k]
    return out.contiguous()


def shard_from_global(full: torch.Tensor, spec: ShardSpec, mesh) -> torch.Tensor:
    """This rank's block of a global tensor, according to ``spec``."""
    index, size = mesh_coords(mesh)
    return take_shard(full, spec, index, size)


def assemble_global(blocks: Sequence[Tuple[dict, torch.Tensor]], spec: ShardSpec, size: dict) -> torch.Tensor:
    """Inverse of :func:`take_shard`: rebuild the global tensor from (index, block) pairs
    covering every coordinate (e.g. gathered from all tensor ranks)."""
    full = torch.empty(spec.global_shape, dtype=blocks[0][1].dtype)
    probe = torch.arange(full.numel()).reshape(spec.global_shape)
    for index, block in blocks:
        pos = take_shard(probe, spec, index, size)
        full.view(-1)[pos.reshape(-1)] = block.reshape(-1).to(full.dtype)
    return full


def set_spec(param: torch.nn.Parameter, spec: ShardSpec) -> torch.nn.Parameter:
    param.shard_spec = spec
    return param


def get_spec(param: torch.Tensor) -> Optional[ShardSpec]:
    return getattr(param, "shard_spec", None)


def sharded_parameter(spec: ShardSpec, mesh, init: Callable[[torch.Tensor], None],
                      dtype: torch.dtype = torch.float32, device=None) -> torch.nn.Parameter:
    """Create the *global* tensor with ``init`` (drawing from torch's default CPU RNG in
    the same order at every layout), keep this rank's block, tag it with ``spec``.

    Because every rank draws the whole global tensor, the same seed gives the same
    global model at any tensor-parallel size. (The transient global tensor is one
    layer at a time; meta-device initialisation for huge layers is future work.)
    """
    full = torch.empty(spec.global_shape, dtype=torch.float32)
    with torch.no_grad():
        init(full)
    local = shard_from_global(full, spec, mesh).to(dtype=dtype, device=device)
    return set_spec(torch.nn.Parameter(local), spec)
