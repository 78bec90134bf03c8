"""The canonical, single-device ``state_dict`` of a laid-out model, gathered on every rank.

For each entry of ``model.state_dict()`` with layout spec S (:class:`ShardSpec`): the T
blocks of the tensor group are all-gathered (payload T·block bytes per rank, outside the
ledger: this is a test/export path, not a training step), placed at their positions in the
global storage tensor (:func:`gridshard.nn.sharding.assemble_global`) and turned into the
canonical tensor (``S.to_canonical``: transpose a Linear2D weight, drop vocabulary
padding). An MoE layer's experts split over E expert ranks (dim 0, the ``expert`` split) are first
all-gathered over ``mesh.expert`` along that dim. Keys and shapes equal the plain model's ``state_dict()``, so
``gathered_state_dict(parallelize(M, mesh)) == M'.state_dict()`` at every layout.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..comm import collectives as C
from ..comm.ledger import LEDGER
from ..errors import LayoutError
from ..nn.sharding import assemble_global, expert_split, mesh_coords, tensor_rank_coords
from .model_context import context_of


def gather_canonical(t: torch.Tensor, spec, mesh) -> torch.Tensor:
    """The canonical global tensor of a block ``t`` laid out by ``spec`` (collective over
    ``mesh.tensor`` when the spec splits anything)."""
    t = t.detach()
    if expert_split(spec) and mesh.expert.size > 1:        # the experts first: dim 0 whole
        with LEDGER.paused():
            t = C.all_gather(t.contiguous(), mesh.expert, 0)
        spec = dataclasses.replace(spec, splits=tuple(s for s in spec.splits if s[1] != "expert"))
    if spec is None:
        return t.cpu().clone()
    if not spec.splits or mesh.tensor.size == 1:          # a snapshot, never a view of the live tensor
        return spec.to_canonical(t.cpu().float() if t.is_floating_point() else t.cpu()).clone()
    _, size = mesh_coords(mesh)
    with LEDGER.paused():
        blocks = C.all_gather(t.contiguous().unsqueeze(0), mesh.tensor, 0).cpu()
    full = assemble_global([(tensor_rank_coords(mesh, r), blocks[r]) for r in range(mesh.tensor.size)], spec, size)
    return spec.to_canonical(full)


def gathered_state_dict(model: torch.nn.Module) -> dict:
    """Canonical state dict (CPU tensors) of a model laid out by :func:`gridshard.parallelize`;
    every tensor rank must call it (it gathers) — under ZeRO-3 every rank (the data ranks first
    gather their chunks of every parameter, :meth:`gridshard.zero.gather.ParameterGather.gathered`, through
    the model's registered ``grad_reducer``)."""
    ctx = context_of(model)
    reducer = getattr(model, "grad_reducer", None)
    out = {}
    with reducer.gathered() if reducer is not None else contextlib.nullcontext():
        for name, t in model.state_dict(keep_vars=True).items():
            out[name] = gather_canonical(t, _layout_of(ctx, name, t), ctx.mesh)
    return out


def _layout_of(ctx, name: str, t: torch.Tensor):
    """The layout ``parallelize`` recorded for parameter ``name``; None for a buffer (held whole)."""
    spec = ctx.layouts.get(name)
    if spec is None and isinstance(t, torch.nn.Parameter):
        raise LayoutError(f"gathered_state_dict: parameter {name!r} has no layout in the model's ParallelContext "
                          f"(it was added or renamed after gridshard.parallelize). Fix: lay the model out with "
                          f"parallelize after it is complete.")
    return spec
