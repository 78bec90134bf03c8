"""The 3D tensor-parallel layout: a q×q×q cube of ranks, T = q³.

Axes and rank order. The T ranks form a DeviceMesh of shape ``(q, q, q)`` with dims
``("weight", "input", "output")``; rank (i, j, l) has weight coordinate i, input coordinate j
and output coordinate l, and the output dim is innermost::

    tensor rank  t = (i·q + j)·q + l

Why this order: the ``input`` and ``output`` dims carry the activation traffic (which grows with
the tokens N, and alternates between the two dims from layer to layer), ``weight`` only the
weight blocks (fixed per layer), so ``weight`` is the outermost dim and the two activation
dims are the q² consecutive ranks of one block (one node when q² ranks fit in it).

The names are the roles the three dims play in a linear layer Y = X·A on this mesh
(:mod:`gridshard.tensor.tp3d.matmul`): X is all-gathered over ``input`` (the q ranks differing in
j), A over ``weight`` (differing in i), and the partial product X_il·A_lj is reduce-scattered
over ``output`` (differing in l).

Activation layout of a mesh. Rank (i, j, l) holds, of an activation X [N, h] (N = b·s tokens,
batch-major, so a batch block is a token block)::

    X[batch block i·q + j of q², hidden block l of q]        shape [b/q², s, h/q]

i.e. the batch is cut into q² blocks indexed by (weight, input) and the hidden dim into q
blocks indexed by output. A linear layer on this mesh consumes this layout and produces the
same layout with the roles of ``input`` and ``output`` exchanged (its output block is
Y[batch block i·q + l, hidden block j]), which is the activation layout of
:meth:`Mesh3D.swapped`. So layers alternate between the mesh and its swapped view: a
linear → linear chain (an MLP, attention's in and out projections) returns to the layout it
started from, and the residual stream keeps one layout. A :class:`Mesh3D` object *is* one
orientation; the swapped view shares every process group and only exchanges which physical
axis plays ``input`` and which ``output``.

Axes of a :class:`Mesh3D` (each a :class:`gridshard.mesh.Axis` recording into the mesh's
ledger under its *physical* name, so a chain's ledger tells which wires were used):

* ``input``, ``weight``, ``output`` (size q): the roles above;
* ``batch`` (size q²): the flattened (weight, input) ranks — those holding the same hidden
  block of an activation, one per batch block, in batch-block order (member index
  i·q + j = my batch block). Vectors (biases, norm weights) are gathered over it, and
  per-batch-block quantities (a valid-target count, an id-range verdict) summed over it are
  the micro-batch's. Physical names ``"weight_input"`` and (swapped) ``"weight_output"``.

Sizes are validated by :func:`validate_3d` before any process group is created. The job mesh
builds one :class:`Mesh3D` for ``tensor_mode: 3d`` through the 3D scheme
(:meth:`~gridshard.tensor.tp3d.scheme.ThreeDScheme.tensor_submesh`); :func:`build_mesh_3d` builds one
for the layers alone.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...errors import LayoutError, check_divisible
from ...mesh import Axis, device_axis, group_timeout_s, set_collective_timeout
from ...torch_private import flatten_mesh


#: the cube's dims, outermost first (3D tensor parallelism; :mod:`gridshard.tensor.tp3d.mesh`)
CUBE_DIMS = ("weight", "input", "output")


def _check_cube_dims(device_mesh: DeviceMesh) -> None:
    names = tuple(device_mesh.mesh_dim_names or ())
    sizes = tuple(device_mesh.mesh.shape)
    if names != CUBE_DIMS or len(set(sizes)) != 1 or sizes[0] < 2:
        raise LayoutError(f"a 3D mesh needs dims {CUBE_DIMS} of sizes (q, q, q) with q ≥ 2, got {names} of sizes "
                          f"{sizes}. Fix: init_device_mesh(device, (q, q, q), mesh_dim_names={CUBE_DIMS}).")


class Mesh3D:
    """One orientation of the 3D axes of this rank (:mod:`gridshard.tensor.tp3d.mesh`'s docstring: the
    cube's rank order, activation layout and the swapped orientation).

    Attributes: ``q``; ``input``, ``weight``, ``output``, ``batch`` (axes); ``is_swapped``;
    ``batch_index`` (my batch block of q², = ``batch.rank``) and ``hidden_index`` (my hidden
    block of q, = ``output.rank``) of this orientation's activation layout. ``swapped()`` is the
    other orientation (same groups). ``coords()`` / ``sizes()``: the physical coordinates
    ``{"weight", "input", "output"}`` that :class:`gridshard.nn.sharding.ShardSpec` splits name."""

    def __init__(self, device_mesh: DeviceMesh, flat_wi: DeviceMesh, flat_wo: DeviceMesh, ledger=None,
                 swapped: bool = False):
        _check_cube_dims(device_mesh)
        phys = {n: device_axis(device_mesh, n, n, ledger) for n in CUBE_DIMS}
        flat = {"weight_input": device_axis(flat_wi, None, "weight_input", ledger),
                "weight_output": device_axis(flat_wo, None, "weight_output", ledger)}
        self._orient(device_mesh.size(0), {**phys, **flat}, ledger, swapped, device_mesh, (flat_wi, flat_wo))

    def _orient(self, q: int, physical: dict, ledger, swapped: bool, device_mesh=None, flat=(None, None)) -> None:
        """Set this orientation's role axes from the five physical axes (``physical``: name → Axis)."""
        self.device_mesh, self.ledger, self.is_swapped, self._flat = device_mesh, ledger, swapped, flat
        self.q = q
        self.physical = physical
        self.weight = physical["weight"]
        self.input, self.output = (physical["output"], physical["input"]) if swapped \
            else (physical["input"], physical["output"])
        self.batch = physical["weight_output"] if swapped else physical["weight_input"]
        self.batch_index, self.hidden_index = self.batch.rank, self.output.rank
        assert self.batch_index == self.weight.rank * self.q + self.input.rank, "batch members are ordered (i, j)"

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh, ledger=None) -> "Mesh3D":
        """The axes of a DeviceMesh with dims ``("weight", "input", "output")`` (e.g. a slice of a
        larger mesh, :func:`gridshard.mesh.layout_mesh` at ``tensor_mode: 3d``). Flattens two of its
        sub-meshes, which creates their process groups: call it once per mesh and reuse the result
        (:meth:`with_ledger`, :meth:`swapped`)."""
        _check_cube_dims(device_mesh)                 # before the flattening creates any group
        flat_wi = flatten_mesh(device_mesh["weight", "input"], "tp3d_weight_input")
        flat_wo = flatten_mesh(device_mesh["weight", "output"], "tp3d_weight_output")
        return cls(device_mesh, flat_wi, flat_wo, ledger)

    @classmethod
    def of_shape(cls, q: int, tensor_rank: int = 0) -> "Mesh3D":
        """The axes of cube rank t = (i·q + j)·q + l with no process group (``group=None``): what the
        layers read to lay a model out on the meta device for a layout nobody launched
        (:class:`gridshard.mesh.ShapeMesh`). It lays out; it never runs a collective."""
        ij, l = divmod(tensor_rank, q)
        i, j = divmod(ij, q)
        me = {"weight": i, "input": j, "output": l, "weight_input": i * q + j, "weight_output": i * q + l}
        physical = {n: Axis(n, q * q if "_" in n else q, r, tuple(range(q * q if "_" in n else q)), None)
                    for n, r in me.items()}
        mesh = cls.__new__(cls)
        mesh._orient(q, physical, None, False)
        return mesh

    def _reoriented(self, ledger, swapped: bool) -> "Mesh3D":
        mesh = Mesh3D.__new__(Mesh3D)
        physical = self.physical if ledger is self.ledger else \
            {n: dataclasses.replace(a, ledger=ledger) for n, a in self.physical.items()}
        mesh._orient(self.q, physical, ledger, swapped, self.device_mesh, self._flat)
        return mesh

    def with_ledger(self, ledger) -> "Mesh3D":
        """The same groups and orientation, recording into ``ledger``."""
        return self._reoriented(ledger, self.is_swapped)

    def swapped(self) -> "Mesh3D":
        """The other orientation: ``input`` and ``output`` exchanged (the layout a linear layer
        on this mesh produces), same groups and ledger."""
        return self._reoriented(self.ledger, not self.is_swapped)

    def coords(self) -> dict:
        """My physical coordinates, the names a 3D :class:`ShardSpec` splits by."""
        return {n: self.physical[n].rank for n in CUBE_DIMS}

    def sizes(self) -> dict:
        return {n: self.q for n in CUBE_DIMS}

    def groups(self) -> list:
        """The distinct process groups of this rank's axes (none on a shape-only mesh)."""
        return [a.group for a in self.physical.values() if a.group is not None]

    def batch_block(self, t: torch.Tensor, dim: int = 0, hidden: bool = True) -> torch.Tensor:
        """My block of a tensor every rank holds whole, in this orientation's activation layout:
        batch block ``batch_index`` of q² along ``dim`` and (``hidden``) hidden block
        ``hidden_index`` of q along the last dim. A plain slice, for inputs and targets."""
        check_divisible(t.shape[dim], self.q ** 2, "batch", "q² (the 3D batch blocks)",
                        f"use a batch that is a multiple of q² = {self.q ** 2}")
        t = t.chunk(self.q ** 2, dim)[self.batch_index]
        return t.chunk(self.q, -1)[self.hidden_index] if hidden else t

    def __repr__(self) -> str:
        c = self.coords()
        return (f"Mesh3D(q={self.q}, i={c['weight']}, j={c['input']}, l={c['output']}"
                f"{', swapped' if self.is_swapped else ''})")


DIM_NAMES = CUBE_DIMS


def valid_3d_sides(limit: int = 64) -> list:
    """The world sizes a 3D layout can use, q³ for q = 2 … while q³ ≤ ``limit``."""
    return [q ** 3 for q in range(2, limit + 1) if q ** 3 <= limit]


def validate_3d(world_size: int, q: int) -> None:
    """q an integer ≥ 2 with q³ = ``world_size``; else one :class:`LayoutError` naming the value,
    the rule and the valid world sizes. Touches no process group."""
    if not isinstance(q, int) or isinstance(q, bool) or q < 2:
        raise LayoutError(f"3D q={q!r} is invalid: the cube side q must be an integer ≥ 2. Fix: use q ≥ 2 "
                          f"(T = q³ ranks: {', '.join(map(str, valid_3d_sides()))}).")
    if q ** 3 != world_size:
        side = round(world_size ** (1 / 3))
        near = f"q={side}" if side >= 2 and side ** 3 == world_size else "no q"
        raise LayoutError(f"3D q={q} needs q³ = {q ** 3} ranks, but the group has {world_size}: T must be a cube "
                          f"({near} fits {world_size}). Fix: launch one of "
                          f"{', '.join(map(str, valid_3d_sides()))} processes (q = 2, 3, 4), or q={q} with "
                          f"{q ** 3}.")


def build_mesh_3d(q: int, ledger=None) -> Mesh3D:
    """Validate, then build (or reuse, :func:`layout_mesh_3d`) the 3D mesh of the whole world
    (T = q³ = world size; layer level: no data or pipeline dims yet). ``ledger``: a
    :class:`gridshard.comm.CommLedger` for its collectives (default: the current ledger)."""
    if not dist.is_initialized():
        raise LayoutError("build_mesh_3d() needs an initialised process group: call gridshard.init_distributed() "
                          "first.")
    validate_3d(dist.get_world_size(), q)
    mesh = layout_mesh_3d(dist.group.WORLD, q)
    return mesh if ledger is None else mesh.with_ledger(ledger)


@functools.lru_cache(maxsize=8)
def layout_mesh_3d(world_group, q: int) -> Mesh3D:
    """The :class:`Mesh3D` of a validated q over ``world_group``: a memo keyed by the group and q
    (each DeviceMesh creates process groups that live as long as the process; every rank calls it
    in the same order), as :func:`gridshard.mesh.layout_mesh` does. Its groups wait as
    long as ``world_group``."""
    device_type = "cuda" if dist.get_backend(world_group) == "nccl" else "cpu"
    mesh = Mesh3D.from_device_mesh(init_device_mesh(device_type, (q, q, q), mesh_dim_names=DIM_NAMES))
    timeout: Optional[float] = group_timeout_s(world_group)
    if timeout is not None:
        set_collective_timeout(mesh.groups(), timeout)
    return mesh
