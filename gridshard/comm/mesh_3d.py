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
(:mod:`gridshard.comm.matmul_3d`): X is all-gathered over ``input`` (the q ranks differing in
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

Sizes are validated by :func:`validate_3d` before any process group is created. The
:class:`Mesh3D` class itself lives in :mod:`gridshard.mesh` (the job mesh builds one for
``tensor_mode: 3d``, and the mesh layer imports no ``comm`` module); it is re-exported here with
the layer-level builder :func:`build_mesh_3d`.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import LayoutError
from ..mesh import CUBE_DIMS as DIM_NAMES
from ..mesh import Mesh3D, group_timeout_s, set_collective_timeout


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
    in the same order), as :func:`gridshard.comm.mesh_2p5d.layout_mesh_2p5d`. Its groups wait as
    long as ``world_group``."""
    device_type = "cuda" if dist.get_backend(world_group) == "nccl" else "cpu"
    mesh = Mesh3D.from_device_mesh(init_device_mesh(device_type, (q, q, q), mesh_dim_names=DIM_NAMES))
    timeout: Optional[float] = group_timeout_s(world_group)
    if timeout is not None:
        set_collective_timeout(mesh.groups(), timeout)
    return mesh
