"""Shard specs: which mesh coordinates split which tensor dims of a parameter.

Every sharded parameter carries a :class:`ShardSpec` (``param.shard_spec``, and
``ParallelContext.layouts`` by name). Initialisation, gathering, checkpoint resharding,
clipping and parameter-byte accounting of a built model read it, and so does the memory
model for a model not yet launched: it lays the model out on the meta device over a
shape-only mesh and reads each spec's :meth:`ShardSpec.local_shape`
(:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`).

A spec is a global shape plus an ordered list of splits ``(tensor_dim, coord)``.
``coord`` names a mesh coordinate: ``"tensor"`` (1D tensor rank t of T),
``"grid_row"`` (row index i of q) or ``"grid_col"`` (column index j of q); in 3D the
cube's physical coordinates ``"weight"``, ``"input"``, ``"output"`` (each of q,
:mod:`gridshard.tensor.tp3d.mesh`; :func:`mesh_coords` reads them from the scheme's tensor dims); and
``"expert"`` (expert rank ε of E, :mod:`gridshard.mesh_expert`: an MoE layer's stacked experts are
split along dim 0, expert rank ε holding experts ε·n/E … (ε+1)·n/E − 1). Splits
apply in order, each narrowing the block left by the previous ones. Examples:

* column-parallel weight [out, in]: ``((0, "tensor"),)`` → rank t holds rows
  t·out/T … (t+1)·out/T.
* Linear2D weight [in, out]: ``((0, "grid_row"), (1, "grid_col"))`` → rank (i, j)
  holds W[i-th in-block, j-th out-block].
* Linear2D bias [out]: ``((0, "grid_col"), (0, "grid_row"))`` → rank (i, j) holds
  the i-th sub-block of the j-th out-block, out/q² elements.

``replicate = r`` makes consecutive groups of r ranks of a split coordinate hold the
same block: the dim is cut into size/r blocks and rank k holds block k // r (grouped-
query attention with more tensor ranks than kv heads: T/kv ranks share one kv head).

The *canonical* tensor (the single-device model's parameter, what checkpoints and
``gathered_state_dict`` hold) is the global tensor described here, transposed when
``transposed`` (a Linear2D stores [in, out]; canonical is [out, in]) and cut to
``canonical_shape`` when given (vocabulary padding rows are local storage only). Where a
rank's block sits in it is :meth:`ShardSpec.canonical_box` (what checkpoints write), and a
ZeRO data rank's elements of that block are the same box narrowed by ``local_box`` (a few
boxes per element range): one description, no second record of where a shard lives.
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
    # mesh axes over which each rank's contribution to this (replicated) parameter's
    # gradient is partial (e.g. a norm weight applied to sequence-sharded activations).
    # The layer itself sums it (it uses the parameter through ``copy_to_group``), so the
    # .grad after backward is already complete: this mark is informational and must not
    # trigger a second reduction.
    partial_grad_axes: Tuple[str, ...] = field(default=())
    replicate: int = 1
    transposed: bool = False
    canonical_shape: Optional[Tuple[int, ...]] = None

    def blocks(self, coord: str, size: int) -> int:
        """Number of distinct blocks a split over ``coord`` (of ``size`` ranks) makes."""
        return size // self.replicate if coord == "tensor" else size

    def local_shape(self, sizes: dict) -> Tuple[int, ...]:
        shape = list(self.global_shape)
        for dim, coord in self.splits:
            n = self.blocks(coord, sizes[coord])
            check_divisible(shape[dim], n, f"dim {dim} of a parameter of shape {self.global_shape}", f"{coord} size")
            shape[dim] //= n
        return tuple(shape)

    def canonical(self) -> Tuple[int, ...]:
        """Shape of the canonical (single-device) tensor."""
        if self.canonical_shape is not None:
            return tuple(self.canonical_shape)
        return tuple(reversed(self.global_shape)) if self.transposed else tuple(self.global_shape)

    def canonical_box(self, index: dict, size: dict,
                      local_box: Optional[Tuple[Tuple[int, int], ...]] = None) -> Optional[Tuple[Tuple[int, int], ...]]:
        """(offset, length) along each canonical dim of the block held at coordinates ``index``
        (padding cut off its end), or None when that box is empty (the block is padding only).

        ``local_box`` = ((lo, hi) per stored dim) narrows the block further to that box of it, in
        storage orientation: a ZeRO data rank's element range of the block is a few such boxes
        (:func:`gridshard.theory.zero.flat_range_boxes`), each this same layout with one more
        narrowing, not a second description. A transposed (Linear2D) block's stored dims are
        canonical dims in reverse."""
        dims = block_dim_indices(self, index, size)
        if local_box is not None:
            dims = [ix[lo:hi] for ix, (lo, hi) in zip(dims, local_box)]
        if self.transposed:
            dims = dims[::-1]
        box = []
        for ix, n in zip(dims, self.canonical()):
            ix = ix[ix < n]
            if len(ix) == 0:
                return None
            box.append((int(ix[0]), len(ix)))
        return tuple(box)

    def canonical_view(self, local: torch.Tensor, box) -> torch.Tensor:
        """The part of ``local`` (a block, or a box of one, in storage orientation) inside ``box``
        (:meth:`canonical_box`), in canonical orientation: a view, writing it writes ``local``."""
        view = local.t() if self.transposed else local
        return view[tuple(slice(0, n) for _, n in box)]

    def to_canonical(self, full: torch.Tensor) -> torch.Tensor:
        """Global storage tensor → canonical tensor (transpose, drop padding)."""
        out = full.t() if self.transposed else full
        return out[tuple(slice(0, n) for n in self.canonical())].contiguous()

    def from_canonical(self, canon: torch.Tensor) -> torch.Tensor:
        """Canonical tensor → global storage tensor (zero padding rows, transpose)."""
        target = tuple(reversed(self.global_shape)) if self.transposed else tuple(self.global_shape)
        if tuple(canon.shape) != target:
            full = canon.new_zeros(target)
            full[tuple(slice(0, n) for n in canon.shape)] = canon
            canon = full
        return canon.t() if self.transposed else canon


def sequence_parallel_on(mesh, requested: bool) -> bool:
    """Whether sequence parallelism is in effect for a layer on ``mesh``: the rule of the mesh's tensor
    scheme (1D with T > 1, :meth:`gridshard.tensor_scheme.TensorScheme.sequence_parallel_in_effect`);
    False without a mesh."""
    return mesh is not None and mesh.tensor_mode.sequence_parallel_in_effect(requested, mesh.tensor.size)


def mesh_coords(mesh) -> Tuple[dict, dict]:
    """(index, size) dicts of the coordinates a spec can name, for this rank of ``mesh``: ``tensor``,
    the tensor dims of the mesh's scheme when there are several (``TensorScheme.tensor_dims``:
    2D ``grid_row``/``grid_col``, 3D the cube's ``weight``/``input``/``output``) and ``expert``."""
    dims = _split_dims(mesh)
    index = {**tensor_rank_coords(mesh, mesh.tensor.rank), "expert": mesh.expert.rank}
    return index, {"tensor": mesh.tensor.size, **dict(dims), "expert": mesh.expert.size}


def expert_split(spec: Optional["ShardSpec"]) -> bool:
    """Whether ``spec`` splits its tensor over the expert ranks (an MoE layer's experts at E > 1)."""
    return spec is not None and any(coord == "expert" for _, coord in spec.splits)


def tensor_rank_coords(mesh, r: int) -> dict:
    """The coordinates (:func:`mesh_coords`' index) of tensor rank ``r`` of ``mesh``'s tensor group: r in
    mixed radix over the scheme's tensor dims, outermost first (t = i·q + j in 2D, t = (i·q + j)·q + l
    in 3D: weight i, input j, output l)."""
    idx = {"tensor": r}
    for name, n in reversed(_split_dims(mesh)):
        r, idx[name] = divmod(r, n)
    return idx


def _split_dims(mesh) -> tuple:
    """The scheme's tensor dims when the tensor dim is laid out on several, else ()."""
    dims = mesh.tensor_mode.tensor_dims(mesh.tensor.size)
    return tuple(dims) if len(dims) > 1 else ()


def take_shard(full: torch.Tensor, spec: ShardSpec, index: dict, size: dict) -> torch.Tensor:
    """The block of ``full`` (global tensor) held by the rank at coordinates ``index``."""
    out = full
    for dim, coord in spec.splits:
        n = spec.blocks(coord, size[coord])
        out = out.chunk(n, dim=dim)[index[coord] * n // size[coord]]
    return out.contiguous()


def block_dim_indices(spec: ShardSpec, index: dict, size: dict) -> list:
    """For each dim of the global storage tensor, the global indices (LongTensor) that this
    rank's block holds along it: the block is their Cartesian product. Same chunking as
    :func:`take_shard`, applied to ``arange``."""
    lists = [torch.arange(n) for n in spec.global_shape]
    for dim, coord in spec.splits:
        n = spec.blocks(coord, size[coord])
        lists[dim] = lists[dim].chunk(n)[index[coord] * n // size[coord]]
    return lists


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
                      dtype: torch.dtype = torch.float32, device=None, coords=None) -> torch.nn.Parameter:
    """Create the *global* tensor with ``init`` (drawing from torch's default CPU RNG in
    the same order at every layout), keep this rank's block, tag it with ``spec``.

    Because every rank draws the whole global tensor, the same seed gives the same
    global model at any tensor-parallel size (this is the direct-use path of the layers;
    :func:`gridshard.parallelize` builds layers on ``device="meta"``, which allocates
    only the local block on the meta device and draws nothing, then materialises the
    block from the plain model's weights or the layout-independent counter RNG).

    ``coords``: the (index, size) dicts the spec's names are read from, default :func:`mesh_coords`
    (a 3D cube orientation passes its own physical coordinates).
    """
    index, size = coords or mesh_coords(mesh)
    if device is not None and torch.device(device).type == "meta":
        # no values yet: ``gridshard.parallelize`` materialises this rank's block later
        return set_spec(torch.nn.Parameter(torch.empty(spec.local_shape(size), dtype=dtype, device="meta")), spec)
    full = torch.empty(spec.global_shape, dtype=torch.float32)
    with torch.no_grad():
        init(full)
    local = take_shard(full, spec, index, size).to(dtype=dtype, device=device)
    return set_spec(torch.nn.Parameter(local), spec)
