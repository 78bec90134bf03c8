"""The 2.5D (Tesseract) layout: d depth layers of a q×q SUMMA grid, T = q²·d ranks.

Axes and rank order. The T ranks of a 2.5D tensor group form a DeviceMesh of shape
``(d, q, q)`` with dims ``("depth", "grid_row", "grid_col")``; the grid column is the
innermost (fastest varying) dim and depth the outermost::

    tensor rank  t = (k·q + i)·q + j        k = depth layer, (i, j) = grid position

Why this order: depth layer k is a block of q² consecutive ranks, so the heavy, q-proportional
SUMMA traffic of every product stays among neighbours (one node), and the depth axis, which
carries only one all-reduce per parameter per backward (the weight gradients), spans the
larger distance. Within a depth layer the names follow the 2D mesh (:mod:`gridshard.mesh`):
``row`` is the group of the q ranks of my grid row (they differ in j; the group *along* the
mesh dim ``grid_col``), ``col`` the group of my grid column (they differ in i).

Data layout. The rows of an activation (the batch) are split into d·q blocks: rank (k, i, j)
holds batch block ``k·q + i`` (block i of depth layer k's slice) and hidden block j, i.e.
[b/(d·q), s, h/q]. Each depth layer is a complete 2D grid over its slice of the batch; the
weights are split q×q as in 2D and *replicated* over the d layers.

Axes of :class:`Mesh2p5D` (each an :class:`gridshard.mesh.Axis`, recording into the mesh's
ledger):

* ``row``, ``col`` (size q): the 2D axes of my depth layer;
* ``depth`` (size d): the d ranks at my grid position (i, j), one per layer: they hold the same
  weight blocks, so a weight's gradient is summed over it;
* ``depth_col`` (size d·q): my grid column j in every layer — it holds every batch block
  k·q + i exactly once, so a per-batch-block quantity (a count, a token-range verdict)
  summed over it is the micro-batch's, the same on every rank of the 2.5D group;
* ``grid``: the flattened q² ranks of my depth layer (the ``tensor`` axis of the 2D view).

``mesh.grid`` is a :class:`Grid2D`: my depth layer seen as a 2D mesh (``q``, ``row``, ``col``,
``grid_row``, ``grid_col``, ``tensor``, ``tensor_mode``), what the 2D layers and SUMMA products
take, so a 2.5D layer is a 2D layer built on ``mesh.grid`` (:mod:`gridshard.comm.depth_ops`).

Sizes are validated by :func:`validate_2p5d` before any process group is created.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import LayoutError, check_divisible
from ..mesh import Axis, TensorMode, _axis, group_timeout_s, set_collective_timeout

DIM_NAMES = ("depth", "grid_row", "grid_col")


def valid_2p5d_shapes(world_size: int) -> list:
    """Every (q, d) with q ≥ 2, d ≥ 1 and q²·d = ``world_size``."""
    return [(q, world_size // (q * q)) for q in range(2, world_size + 1) if q * q <= world_size
            and world_size % (q * q) == 0]


def validate_2p5d(world_size: int, q: int, d: int) -> None:
    """q ≥ 2, d ≥ 1 integers with q²·d = ``world_size``; else one :class:`LayoutError` naming the
    values, the rule and the valid (q, d) for this world size. Touches no process group."""
    for name, v, lo in (("q", q, 2), ("d", d, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise LayoutError(f"2.5D {name}={v!r} is invalid: the grid side q must be an integer ≥ 2 and the depth "
                              f"d an integer ≥ 1. Fix: use q ≥ 2 (d = 1 is 2D SUMMA).")
    if q * q * d != world_size:
        shown = ", ".join(f"(q={a}, d={b})" for a, b in valid_2p5d_shapes(world_size)) or "none"
        raise LayoutError(f"2.5D q={q}, d={d} needs q²·d = {q * q * d} ranks, but the group has {world_size}: "
                          f"T must equal q²·d. Fix: choose one of {shown} for {world_size} ranks, or launch "
                          f"{q * q * d} processes.")


def _check_dims(device_mesh: DeviceMesh) -> None:
    names = tuple(device_mesh.mesh_dim_names or ())
    if names != DIM_NAMES or device_mesh.size(1) != device_mesh.size(2) or device_mesh.size(1) < 2:
        raise LayoutError(f"a 2.5D mesh needs dims {DIM_NAMES} of sizes (d, q, q) with q ≥ 2, got {names} of "
                          f"sizes {tuple(device_mesh.mesh.shape)}. Fix: init_device_mesh(device, (d, q, q), "
                          f"mesh_dim_names={DIM_NAMES}).")


@dataclass(frozen=True)
class Grid2D:
    """One depth layer's q×q grid as a 2D mesh: the attributes the 2D layers, their shard specs
    (``tensor``, ``grid_row``, ``grid_col``) and the SUMMA products read of a 2D
    :class:`gridshard.mesh.ParallelMesh`."""

    q: int
    row: Axis
    col: Axis
    tensor: Axis
    ledger: object = None
    tensor_mode: TensorMode = TensorMode.parse("2d")

    @property
    def grid_row(self) -> int:
        return self.col.rank

    @property
    def grid_col(self) -> int:
        return self.row.rank


class Mesh2p5D:
    """The 2.5D axes of this rank (module docstring), over a DeviceMesh with dims
    ``("depth", "grid_row", "grid_col")`` and its two flattened meshes (``grid``, ``depth_col``).

    Attributes: ``q``, ``d``; ``depth``, ``depth_col``, ``row``, ``col`` (axes); ``grid`` (the
    :class:`Grid2D` of my layer); ``depth_index`` k, ``grid_row`` i, ``grid_col`` j;
    ``batch_index`` = k·q + i (my batch block of d·q)."""

    def __init__(self, device_mesh: DeviceMesh, grid_mesh: DeviceMesh, depth_col_mesh: DeviceMesh, ledger=None):
        _check_dims(device_mesh)
        self.device_mesh, self.ledger = device_mesh, ledger
        self._flat = (grid_mesh, depth_col_mesh)
        self.d, self.q = device_mesh.size(0), device_mesh.size(1)
        self.depth = _axis(device_mesh, "depth", "depth", ledger)
        self.row = _axis(device_mesh, "grid_col", "row", ledger)
        self.col = _axis(device_mesh, "grid_row", "col", ledger)
        self.depth_col = _axis(depth_col_mesh, None, "depth_col", ledger)
        self.grid = Grid2D(self.q, self.row, self.col, _axis(grid_mesh, None, "tensor", ledger), ledger)
        self.depth_index, self.grid_row, self.grid_col = self.depth.rank, self.col.rank, self.row.rank
        self.batch_index = self.depth_index * self.q + self.grid_row
        assert self.depth_col.rank == self.batch_index, "depth_col members are ordered (k, i)"

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh, ledger=None) -> "Mesh2p5D":
        """The axes of a DeviceMesh with dims ``("depth", "grid_row", "grid_col")`` (e.g. a slice
        of a larger mesh). Flattens two of its sub-meshes, which creates their process groups:
        call it once per mesh and reuse the result (:meth:`with_ledger` for another ledger)."""
        _check_dims(device_mesh)                 # before the flattening creates any group
        grid = device_mesh["grid_row", "grid_col"]._flatten("tp2p5d_grid")
        depth_col = device_mesh["depth", "grid_row"]._flatten("tp2p5d_depth_col")
        return cls(device_mesh, grid, depth_col, ledger)

    def with_ledger(self, ledger) -> "Mesh2p5D":
        """The same groups, recording into ``ledger``."""
        return Mesh2p5D(self.device_mesh, *self._flat, ledger)

    def groups(self) -> list:
        """The distinct process groups of this rank's axes (size-1 axes have none)."""
        out = []
        for g in (a.group for a in (self.depth, self.row, self.col, self.depth_col, self.grid.tensor)):
            if g is not None and all(g is not h for h in out):
                out.append(g)
        return out

    def batch_block(self, t: torch.Tensor, dim: int = 0, hidden: bool = True) -> torch.Tensor:
        """My block of a tensor every rank holds whole: batch block k·q + i of d·q along ``dim``
        and (``hidden``) hidden block j of q along the last dim. A plain slice (no autograd
        collective): for inputs and targets, not for tensors that need a gradient back."""
        check_divisible(t.shape[dim], self.d * self.q, "batch", "d·q (the 2.5D batch blocks)",
                        f"use a batch that is a multiple of d·q = {self.d * self.q}")
        t = t.chunk(self.d * self.q, dim)[self.batch_index]
        return t.chunk(self.q, -1)[self.grid_col] if hidden else t

    def __repr__(self) -> str:
        return f"Mesh2p5D(q={self.q}, d={self.d}, k={self.depth_index}, i={self.grid_row}, j={self.grid_col})"


def build_mesh_2p5d(q: int, d: int, ledger=None) -> Mesh2p5D:
    """Validate, then build (or reuse, :func:`layout_mesh_2p5d`) the 2.5D mesh of the whole
    world (T = q²·d = world size; layer level: no data or pipeline dims yet). ``ledger``: a
    :class:`gridshard.comm.CommLedger` for its collectives (default: the current ledger)."""
    if not dist.is_initialized():
        raise LayoutError("build_mesh_2p5d() needs an initialised process group: call "
                          "gridshard.init_distributed() first.")
    validate_2p5d(dist.get_world_size(), q, d)
    mesh = layout_mesh_2p5d(dist.group.WORLD, q, d)
    return mesh if ledger is None else mesh.with_ledger(ledger)


@functools.lru_cache(maxsize=8)
def layout_mesh_2p5d(world_group, q: int, d: int) -> Mesh2p5D:
    """The :class:`Mesh2p5D` of a validated (q, d) over ``world_group``: a memo keyed by the
    group and the shape, bounded to 8 shapes, for the same reason as :func:`gridshard.mesh.layout_mesh`
    (each DeviceMesh creates process groups that live as long as the process; every rank calls
    it in the same order). Its groups wait as long as ``world_group``."""
    device_type = "cuda" if dist.get_backend(world_group) == "nccl" else "cpu"
    mesh = Mesh2p5D.from_device_mesh(init_device_mesh(device_type, (d, q, q), mesh_dim_names=DIM_NAMES))
    timeout: Optional[float] = group_timeout_s(world_group)
    if timeout is not None:
        set_collective_timeout(mesh.groups(), timeout)
    return mesh
