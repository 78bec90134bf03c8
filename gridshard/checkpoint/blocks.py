"""Each rank's pieces of the canonical global tensors, and the DCP planners that write and
read exactly those pieces.

A checkpoint holds *canonical* tensors: the single-device model's names and shapes
(``[out, in]`` weights, unpadded vocabulary), whatever layout wrote them. A rank holds, for
every parameter (and every AdamW moment, which has its parameter's layout), one block of
that canonical tensor: by its layout (:meth:`gridshard.nn.sharding.ShardSpec.canonical_box`), a
box ``offsets[d] … offsets[d] + sizes[d]`` along each canonical dim d, after transposing a
Linear2D block back to ``[out, in]`` and cutting vocabulary padding off its end; under ZeRO the
same layout narrowed to the data rank's rows of the block.

:class:`CanonicalBlock` is that box: the fqn, the canonical global size, the offsets and a
*view* of the local storage in canonical orientation (writing the view writes the
parameter). Boxes are all a checkpoint needs, so every layout is covered the same way —
1D/2D/none, sequence parallel, grouped-query kv blocks replicated over T/kv ranks, 2D norm
vectors cut into q² pieces — including the layouts DTensor placements cannot express.

Why hand-written planners: PyTorch's distributed checkpoint (DCP) treats a plain tensor as
a whole replicated tensor at offset 0, so a manually sharded model saved with it silently
keeps one rank's shard. DCP's documented extension point is the planner;
:class:`BlockSavePlanner` turns each block into one DCP write item (a chunk at its
offsets), and :class:`BlockLoadPlanner` asks, for each local block, for the overlap with
every saved chunk (``create_read_items_for_chunk_list``). DCP does the rest: identical
chunks written by several ranks (data-parallel replicas, replicated norms and kv groups) are
deduplicated to one writer, and reading at another layout is the overlap computation —
resharding by placement alone.

Bytes: each rank writes Σ over the blocks it is chosen for (after deduplication every
canonical element is written once: the checkpoint holds ``Σ numel(canonical) · 4`` bytes of
fp32 model plus twice that of AdamW moments), and reads exactly its own blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import LayoutError
from ..nn.sharding import ShardSpec, mesh_coords

MODEL = "model."
OPTIM = "optim."
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class CanonicalBlock:
    """This rank's box of the canonical tensor ``fqn`` (module docstring)."""

    fqn: str
    global_size: tuple
    offsets: tuple
    view: torch.Tensor

    @property
    def sizes(self) -> tuple:
        return tuple(self.view.shape)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


def canonical_block(fqn: str, local: torch.Tensor, spec: ShardSpec, mesh,
                    rows: Optional[tuple] = None) -> Optional[CanonicalBlock]:
    """The box of ``local`` (this rank's block stored by ``spec``, or with ``rows = (start, stop)``
    those rows of it: a ZeRO shard) in its canonical tensor (:meth:`ShardSpec.canonical_box`),
    or None when it holds only padding."""
    box = spec.canonical_box(*mesh_coords(mesh), rows=rows)
    if box is None:
        return None
    return CanonicalBlock(fqn, tuple(spec.canonical()), tuple(o for o, _ in box),
                          spec.canonical_view(local.detach(), box))


def _stepped_tensors(model: torch.nn.Module, reducer=None):
    """(name, the tensor the optimizer steps, box) for every trainable parameter once (tied weights
    under their first name): what ``reducer`` (:class:`gridshard.zero.reducer.GradReducer`) steps —
    the parameter itself, or under ZeRO this data rank's rows of it —, without one every parameter.
    ``box(fqn, t)`` is the :class:`CanonicalBlock` of a tensor ``t`` laid out like that one
    (the parameter or one of its AdamW moments): the parameter's layout, narrowed to the rows."""
    from ..zero.reducer import whole_parameters

    ctx = model.parallel_context
    for s in (reducer.stepped() if reducer is not None else whole_parameters(model)):
        spec = ctx.layouts[s.name]
        yield s.name, s.tensor, (lambda fqn, t, spec=spec, rows=s.rows:
                                 canonical_block(fqn, t, spec, ctx.mesh, rows))


def model_blocks(model: torch.nn.Module, reducer=None) -> dict:
    """fqn → block for every trainable parameter once (tied weights under their first name)
    of a model laid out by :func:`gridshard.parallelize`; fqn = ``"model." + name``. With a ZeRO
    ``reducer`` (:class:`gridshard.zero.ZeroDataParallel`) each data rank's block is its rows only
    (the shard: the parameter itself is not gathered under ZeRO-3)."""
    out = {}
    for name, t, box in _stepped_tensors(model, reducer):
        b = box(MODEL + name, t)
        if b is not None:
            out[b.fqn] = b
    return out


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW state (zero moments, step 0) if it has none yet, in the
    form ``torch.optim.AdamW`` itself creates on its first step, so a checkpoint can be read
    into it before any step."""
    inner = getattr(optimizer, "inner", None)          # host-memory AdamW (gridshard.zero.offload)
    if inner is not None:
        return ensure_adam_state(inner)
    for group in optimizer.param_groups:
        fused_or_capturable = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            step_device = p.device if fused_or_capturable else torch.device("cpu")
            st["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_state(optimizer, tensor) -> dict:
    """The AdamW state of ``tensor`` (an optimizer that keeps it elsewhere, e.g. in host memory,
    answers through ``state_for``)."""
    lookup = getattr(optimizer, "state_for", None)
    return lookup(tensor) if lookup is not None else optimizer.state.get(tensor)


def optimizer_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer=None) -> dict:
    """fqn → block of each AdamW moment (``optim.<param>.exp_avg`` / ``.exp_avg_sq``, the
    parameter's layout) plus ``optim.step`` (the shared step count, replicated, stored as shape [1]).
    Under a ZeRO ``reducer`` the moments are the shards' (rows of the parameter's block)."""
    ensure_adam_state(optimizer)
    out, step = {}, None
    for name, t, box in _stepped_tensors(model, reducer):
        st = adam_state(optimizer, t) if t.numel() else None
        if not st:
            continue
        for key in ADAM_MOMENTS:
            b = box(f"{OPTIM}{name}.{key}", st[key])
            if b is not None:
                out[b.fqn] = b
        step = st["step"]
    if step is not None:
        out[OPTIM + "step"] = CanonicalBlock(OPTIM + "step", (1,), (0,), step.detach().reshape(1))
    return out


def set_optimizer_step(optimizer: torch.optim.Optimizer, value: torch.Tensor) -> None:
    """Write the loaded shared step count into every parameter's state."""
    optimizer = getattr(optimizer, "inner", optimizer)
    for st in optimizer.state.values():
        if "step" in st:
            st["step"].copy_(value.to(st["step"].dtype).reshape(st["step"].shape))


class BlockSavePlanner(DefaultSavePlanner):
    """Writes each staged block as one chunk at its offsets (module docstring).

    ``state_dict`` (what DCP stages and passes in) maps fqn → the block's data;
    ``boxes`` maps fqn → :class:`CanonicalBlock` (offsets and global size)."""

    def __init__(self, boxes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, data in self.state_dict.items():
            b = self.boxes[fqn]
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=b.chunk(), properties=TensorProperties(dtype=data.dtype),
                                            size=torch.Size(b.global_size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn]


class BlockLoadPlanner(DefaultLoadPlanner):
    """Reads into each local block the parts of every saved chunk that overlap it."""

    def __init__(self, boxes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, b in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, md, [b.chunk()])
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[index.fqn].view


def check_against_metadata(boxes: dict, metadata, where: str) -> None:
    """Every block has a saved tensor of its canonical size (same check on every rank, before
    any collective): a clear error naming the first mismatch."""
    saved = metadata.state_dict_metadata
    for fqn, b in boxes.items():
        md = saved.get(fqn)
        if md is None:
            near = sorted(k for k in saved if k.startswith(fqn.split(".")[0]))[:4]
            raise LayoutError(f"checkpoint {where} has no tensor {fqn!r} (it holds e.g. {near}). Fix: resume with the "
                              f"model the checkpoint was written with (same names and tied embeddings).")
        if not isinstance(md, TensorStorageMetadata):
            raise LayoutError(f"checkpoint {where}: {fqn!r} is not stored as a tensor. Fix: use a checkpoint written "
                              f"by gridshard.")
        if tuple(md.size) != tuple(b.global_size):
            raise LayoutError(f"checkpoint {where}: {fqn!r} has shape {tuple(md.size)}, the model expects "
                              f"{tuple(b.global_size)}. Fix: resume with the model the checkpoint was written with.")


def staged_copy(boxes: dict) -> dict:
    """fqn → a contiguous CPU copy of each block: what an asynchronous save writes while
    training goes on changing the parameters."""
    return {fqn: b.view.detach().to("cpu", copy=True).contiguous() for fqn, b in boxes.items()}
