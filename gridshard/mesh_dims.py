"""The mesh dimensions outside the tensor dims, declared as data: what each adds to the mesh.

A job's DeviceMesh is ``(outer dims…, tensor dims…)``. The tensor dims are the tensor scheme's
(:meth:`gridshard.tensor_scheme.TensorScheme.tensor_dims`); the outer ones are declared here, in
mesh order (outermost first), each saying

* ``name``: the DeviceMesh dim name (and ``parallel.<name>`` in the config where it has a key);
* ``always``: whether the dim is in the DeviceMesh at size 1 too (data and pipeline: every job
  has them; context and depth only when larger than 1, so a job without them is laid out
  exactly as before they existed);
* ``replicates_weights``: whether parameters are replicated along it, so that their gradients
  are reduced over it: these dims (with a mode's own ``weight_replica_dims``) are flattened
  into the reducer's ``data_context`` axis (D·C[·d] ranks);
* ``cost``: the module that prices its collectives in the planner.

The global rank of a coordinate is the row-major index over the dims present, tensor innermost::

    global_rank = (((d · P + p) · C + c) · depth + k) · T + t

Adding a mesh dimension is one entry here, its axis on :class:`gridshard.mesh.ParallelMesh`, and
its cost module. The expert dimension is not one: it cuts the ``data_context`` groups
(:mod:`gridshard.mesh_expert`). Imports nothing.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshDim:
    """One outer dimension of the mesh (module docstring)."""

    name: str
    always: bool
    replicates_weights: bool
    cost: str


#: the outer dims in mesh order (outermost first)
OUTER_DIMS = (
    MeshDim("data", always=True, replicates_weights=True, cost="gridshard.planner.price_data"),
    MeshDim("pipeline", always=True, replicates_weights=False, cost="gridshard.planner.price_pipeline"),
    MeshDim("context", always=False, replicates_weights=True, cost="gridshard.planner.price_context"),
    MeshDim("depth", always=False, replicates_weights=True, cost="gridshard.tensor.tp2p5d.theory"),
)


def outer_layout(sizes: dict) -> tuple:
    """``((name, size), …)`` of the outer dims a job with these sizes (name → size; a missing
    name is 1) builds, in mesh order: every ``always`` dim, the others when larger than 1."""
    return tuple((d.name, sizes.get(d.name, 1)) for d in OUTER_DIMS if d.always or sizes.get(d.name, 1) > 1)


def weight_replica_dims(names) -> tuple:
    """The dims of ``names`` along which parameters are replicated (their gradients reduced)."""
    replicating = {d.name for d in OUTER_DIMS if d.replicates_weights}
    return tuple(n for n in names if n in replicating)
