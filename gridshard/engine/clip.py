"""Global gradient norm over a sharded, replicated model, each parameter counted once.

    ‖g‖ = sqrt( Σ_params Σ_distinct blocks ‖g_block‖² )

After data-parallel averaging every data rank holds the same gradients, so the norm
is a tensor-group quantity. Within the tensor group a parameter's block is either
unique to a rank or repeated: its ``shard_spec`` names the mesh coordinates that split
it; over the *other* tensor coordinates it is replicated. A rank counts a block only
if its index along every replicated coordinate is 0:

* 1D (coordinate ``tensor``): split → every rank counts its block; no splits → rank 0;
* 2D (coordinates ``grid_row``, ``grid_col``; ``tensor`` covers both): e.g. a weight
  split by ``grid_col`` only is counted by grid row 0; no splits → rank (0, 0);
* 3D (coordinates ``weight``, ``input``, ``output`` of the q×q×q cube): every 3D parameter,
  vectors included, is split over all three (1/q³ each, no tensor replicas), so every rank
  counts its block once; a tied head reads the embedding's own parameter (one block, once).

Each rank sums its counted squares, one all-reduce of one float over ``mesh.tensor``
adds them (8 bytes per step when T > 1; float64 for a layout-independent sum). An MoE layer's
experts split over E expert ranks (:mod:`gridshard.mesh_expert`) are distinct blocks on each of
them: held whole (ZeRO-0) their squares are first summed over ``mesh.expert`` (one more 8-byte
all-reduce); as ZeRO shards the data sum below covers them (expert × expert-data = data ranks).
Clipping then scales every gradient by min(1, max_norm / (‖g‖ + 1e-6)) without a
host sync.
"""
from __future__ import annotations

import torch

from ..comm import collectives as C
from ..nn.sharding import expert_split, get_spec, mesh_coords
from ..torch_private import foreach_mul_, foreach_norm


def counts_here(p: torch.Tensor, mesh, spec=None) -> bool:
    """Whether this rank adds ``p``'s block to the global norm (module docstring); ``spec``
    is the parameter's layout (``model.parallel_context.layouts``), else its ``shard_spec``."""
    index, _ = mesh_coords(mesh)
    basis = set(index) - {"tensor", "expert"} or {"tensor"}     # the tensor dims: 1D tensor, 2D grid, 3D cube
    spec = spec if spec is not None else get_spec(p)
    split = {coord for _, coord in spec.splits} if spec is not None else set()
    if "tensor" in split:
        split |= basis
    if spec is not None and spec.replicate > 1 and index["tensor"] % spec.replicate:
        return False                  # a kv block shared by `replicate` ranks: counted by the first
    return all(index[c] == 0 for c in basis - split)


def _squares(grads: list, device) -> torch.Tensor:
    """Σ ‖g‖² over ``grads`` (0-dim float64)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(foreach_norm([g.float() for g in grads])).double().pow(2).sum()


def global_grad_norm(params, mesh, specs=None, pipeline_axis=None, data_axis=None,
                     expert_axis=None) -> torch.Tensor:
    """‖g‖ over the global model (a 0-dim float64 tensor, equal on every rank). ``specs``:
    the layouts of ``params`` in the same order (default: each parameter's ``shard_spec``).
    ``pipeline_axis``: with pipeline stages each rank holds some layers only; the tensor
    group's sum of squares is summed over the stages too (one more 8-byte all-reduce;
    ``params`` must list a tied weight on one stage only). ``data_axis``: ``params`` are ZeRO
    shards, each data rank holding different elements of every block, so the sum of squares is
    summed over data ranks too (one more 8-byte all-reduce); a shard's tensor-group rule is
    its parameter's (``specs``). ``expert_axis``: whole expert blocks differ over it (module docstring)."""
    specs = list(specs) if specs is not None else [None] * len(params)
    pairs = [(p, s) for p, s in zip(params, specs) if p.grad is not None]
    device = pairs[0][0].grad.device if pairs else torch.device("cpu")
    mine = [(p.grad, expert_axis is not None and expert_split(s if s is not None else get_spec(p)))
            for p, s in pairs if counts_here(p, mesh, s)]
    local = _squares([g for g, by_expert in mine if not by_expert], device)
    if expert_axis is not None:
        local += C.all_reduce(_squares([g for g, by_expert in mine if by_expert], device), expert_axis, inplace=True)
    total = C.all_reduce(local, mesh.tensor, inplace=True)        # local, total: temporaries
    if data_axis is not None:
        total = C.all_reduce(total, data_axis, inplace=True)
    if pipeline_axis is not None:
        total = C.all_reduce(total, pipeline_axis, inplace=True)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(params, total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so the global norm is at most ``max_norm`` (0 = off).

    The gradients are grouped by (device, dtype), in order: one :func:`gridshard.torch_private.foreach_mul_` per group
    scales them (one multi-tensor kernel on CUDA instead of one launch per tensor); each element is
    multiplied by the same coefficient, cast to its dtype, as a per-tensor ``mul_`` would, so the
    result is the same bit for bit."""
    if max_norm <= 0:
        return
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        foreach_mul_(grads, coef.to(device=device, dtype=dtype))
