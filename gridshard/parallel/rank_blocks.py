"""One rank's parameter blocks, read from a model laid out on the meta device.

The memory model (:func:`gridshard.theory.memory.predict_rank_memory`) and the planner need the
local shape of every parameter one rank holds, for layouts that were never launched. They do not
describe those shapes a second time: :func:`laid_out_model` builds the model on the meta device,
lays it out with :func:`gridshard.parallelize` itself on a :class:`gridshard.mesh.ShapeMesh` (the
layout's sizes and a rank's coordinates, no process group; ``device="meta"``, so no value is
evaluated) and reads every parameter's layout, ``ShardSpec.local_shape``
(:mod:`gridshard.nn.sharding`). A layer kind added to the model, the plan or the layer
constructors is in the memory model and the planner as soon as ``parallelize`` builds it.

Cost: the decoder layers of :class:`gridshard.models.Transformer` have one layout per kind
(dense, or MoE where ``cfg.is_moe_layer(i)``), so ``moe_every`` layers are laid out, not L (one
for a dense model or every layer MoE; layer ``moe_every − 1`` is the MoE kind): a rank's blocks
are the root parameters it holds plus, for each of its decoder layers i, its kind's blocks renamed
to ``layers.i.``. An MoE layer's experts split over E expert ranks (``expert``) are marked
(``ParamBlock.expert``: ZeRO shards them over the expert-data ranks). About 2 ms per (model, tensor mode, T); the planner memoises it
(:mod:`gridshard.planner.memo`).

Pipeline ranks: the root parameters registered before the decoder layers (the embedding) go
with the first stage, those after them (final norm, head) with the last. A tied head is the
embedding's parameter: listed once on a rank holding both ends, and under the embedding's name
on a last stage without the first (each end holds its own copy, :mod:`gridshard.pipeline.tied`).
All tensor ranks of a layout hold blocks of the same shapes (vocabulary padding included), so
the blocks of tensor rank 0 stand for every rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import torch

from ..errors import LayoutError
from ..job_layout import TensorMode
from ..nn.sharding import expert_split, mesh_coords
from ..theory.memory import ParamBlock, kv_replica_grad_extra
from .decoder_layers import layer_parameter

@dataclass(frozen=True)
class LaidOutModel:
    """The local blocks (name, shape) of tensor rank 0 of a model laid out for one tensor mode
    and size, split as a pipeline places them (module docstring): ``first`` the root parameters
    before the decoder layers, ``layer`` one decoder layer's (names relative to the layer, with
    the gradient elements each keeps alive beyond its block), ``last`` the root parameters after
    them, each with the ``first`` name it is tied to (or None)."""

    first: Tuple[Tuple[str, tuple], ...]
    layer: Tuple[Tuple[str, tuple, int, bool], ...]
    last: Tuple[Tuple[str, tuple, Optional[str]], ...]
    moe_layer: Tuple[Tuple[str, tuple, int, bool], ...] = ()      # an MoE layer's (name, shape, extra, expert)
    moe_every: int = 0                                            # layer i is MoE when (i+1) % moe_every == 0

    def rank_blocks(self, layer_ids: Iterable[int], has_embedding: bool = True, has_head: bool = True) -> list:
        """The :class:`ParamBlock` list of a rank holding decoder layers ``layer_ids`` and the
        first / last stage's root parameters when ``has_embedding`` / ``has_head``."""
        blocks = [ParamBlock(name, shape) for name, shape in self.first] if has_embedding else []
        for i in layer_ids:
            kind = self.moe_layer if self.moe_every and (i + 1) % self.moe_every == 0 else self.layer
            blocks += [ParamBlock(f"layers.{i}.{name}", shape, i, extra, by_expert)
                       for name, shape, extra, by_expert in kind]
        if has_head:
            blocks += [ParamBlock(tied_to or name, shape) for name, shape, tied_to in self.last
                       if not (has_embedding and tied_to is not None)]
        return blocks


def laid_out_model(cfg, mode="none", T: int = 1, expert: int = 1) -> LaidOutModel:
    """Lay out the model of ``cfg`` (a :class:`gridshard.models.ModelConfig`: the decoder; a
    :class:`gridshard.models.vit.ViTConfig`: the ViT, encoder layers ``vit.encoder.layer.N``) with one
    layer of each kind on the meta device for tensor mode ``mode``, size ``T`` and ``expert`` expert
    ranks (module docstring) and read its parameters' layouts."""
    from ..mesh import ShapeMesh
    from .parallelize import parallelize

    mode = TensorMode.parse(mode)
    every = cfg.moe_every if cfg.experts else 0
    with torch.device("meta"):
        plain = dataclasses.replace(cfg, layers=max(1, every)).build()
    mesh = ShapeMesh(data=expert, tensor=T, tensor_mode=mode, expert=expert)
    model = parallelize(plain, mesh, device="meta")
    _, size = mesh_coords(mesh)
    layouts = model.parallel_context.layouts
    extra = kv_replica_grad_extra(cfg, mode, T)
    first, dense, moe, last, owner = [], [], [], [], {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shape = layouts[name].local_shape(size)
        if tuple(param.shape) != shape:
            raise LayoutError(f"parameter {name!r}: the layer built a {tuple(param.shape)} block but its layout "
                              f"says {shape}. Fix: make the layer's ShardSpec describe the block it allocates.")
        tied_to = owner.setdefault(id(param), name)
        in_layer = layer_parameter(name)
        if in_layer is not None:                            # layer 0 the dense kind, layer every − 1 the MoE kind
            i, rel = in_layer
            block = (rel, shape, extra.get(rel, 0), expert_split(layouts[name]))
            for kind, index in ((dense, 0), (moe, every - 1 if every else None)):
                if i == index:
                    kind.append(block)
        elif not dense:
            first.append((name, shape))
        else:
            last.append((name, shape, tied_to if tied_to != name else None))
    return LaidOutModel(tuple(first), tuple(dense), tuple(last), tuple(moe), every)


def rank_parameter_blocks(cfg, mode="none", T: int = 1, layer_ids: Optional[Iterable[int]] = None,
                          has_embedding: bool = True, has_head: bool = True, expert: int = 1) -> list:
    """The :class:`ParamBlock` list of one rank of ``gridshard.parallelize(cfg.build(), mesh)``
    (``mode``, ``T``: the mesh's tensor mode and size): the layouts of :func:`laid_out_model`.
    ``layer_ids``: this pipeline rank's decoder layers (default all); ``has_embedding`` /
    ``has_head``: whether it holds the first / last stage (the final norm goes with the head);
    ``expert``: the expert ranks an MoE model's experts are split over."""
    layers = range(cfg.layers) if layer_ids is None else layer_ids
    return laid_out_model(cfg, mode, T, expert).rank_blocks(layers, has_embedding, has_head)


__all__ = ["LaidOutModel", "laid_out_model", "rank_parameter_blocks"]
