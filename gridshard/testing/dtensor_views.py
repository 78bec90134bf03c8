"""DTensor views of a laid-out model's parameters, for tests (and inspection): each block
as a DTensor of the *canonical* global tensor, sharing the parameter's storage, where its
layout has standard placements (:func:`gridshard.parallel.dtensor_view.placements_of`; the
table of which layouts do is in that module's docstring). ``full_tensor()`` of a view is
the canonical tensor.

Views share storage with the parameters (no copy): writing into a view's local tensor
writes the parameter.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..nn.sharding import ShardSpec, mesh_coords
from ..parallel.model_context import context_of
from ..parallel.dtensor_view import placements_of, tensor_dim_names


def tensor_submesh(mesh):
    """The DeviceMesh of the tensor dims: ``tensor`` (1D) or ``(grid_row, grid_col)`` (2D)."""
    names = tensor_dim_names(mesh)
    return mesh.device_mesh[names if len(names) > 1 else names[0]]


def dtensor_view(t: torch.Tensor, spec: ShardSpec, mesh) -> Optional[DTensor]:
    """The canonical global tensor of block ``t`` as a DTensor sharing its storage, or None
    when the layout has no standard placements (module docstring)."""
    placements = placements_of(spec, mesh)
    if placements is None:
        return None
    canon = spec.canonical()
    box = spec.canonical_box(*mesh_coords(mesh)) or tuple((0, 0) for _ in canon)    # None: padding only
    local = spec.canonical_view(t.detach(), box)
    return DTensor.from_local(local, tensor_submesh(mesh), placements, run_check=False, shape=torch.Size(canon),
                              stride=torch.empty(canon, device="meta").stride())


def dtensor_state_dict(model: torch.nn.Module) -> dict:
    """name → DTensor view (or None where the layout has no standard placements), for every
    entry of ``model.state_dict()``."""
    ctx = context_of(model)
    if not any(spec.splits for spec in ctx.layouts.values()):          # nothing split: the plain tensors
        return dict(model.state_dict())
    return {name: dtensor_view(t, ctx.layouts[name], ctx.mesh)
            for name, t in model.state_dict(keep_vars=True).items()}
