"""Each rank's pieces of the canonical global tensors, and the DCP planners that write and
read exactly those pieces.

A checkpoint holds *canonical* tensors: the single-device model's names and shapes
(``[out, in]`` weights, unpadded vocabulary), whatever layout wrote them. A rank holds, for
every parameter (and every AdamW moment, which has its parameter's layout), one block of
that canonical tensor: by its layout (:meth:`gridshard.nn.sharding.ShardSpec.canonical_box`), a
box ``offsets[d] … offsets[d] + sizes[d]`` along each canonical dim d, after transposing a
Linear2D block back to ``[out, in]`` and cutting vocabulary padding off its end; under ZeRO the
same layout narrowed to the data rank's element range of the block, which is up to three boxes
of a matrix (a partial first row, whole rows, a partial last row:
:func:`gridshard.theory.zero.flat_range_boxes`), so a rank may hold several blocks of one
tensor, keyed ``fqn@offsets`` (:func:`block_key`). The saved chunks of one tensor are disjoint
and cover it (element ranges of different data ranks are disjoint), as DCP requires.

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
                    local_box: Optional[tuple] = None) -> Optional[CanonicalBlock]:
    """The box of ``local`` (this rank's block stored by ``spec``, or with ``local_box`` = ((lo, hi)
    per stored dim) that box of it, ``local`` then in the box's shape: a piece of a ZeRO element
    range) in its canonical tensor (:meth:`ShardSpec.canonical_box`), or None when it holds only
    padding."""
    box = spec.canonical_box(*mesh_coords(mesh), local_box=local_box)
    if box is None:
        return None
    return CanonicalBlock(fqn, tuple(spec.canonical()), tuple(o for o, _ in box),
                          spec.canonical_view(local.detach(), box))


def block_key(block: CanonicalBlock, piece: bool) -> str:
    """The key of ``block`` in a rank's dict of blocks (and in DCP's state dict): its fqn, or for a
    piece of an element range — a parameter may have several on one rank — ``fqn@offsets``."""
    return f"{block.fqn}@{','.join(map(str, block.offsets))}" if piece else block.fqn


def _written_once(model: torch.nn.Module, name: str) -> bool:
    """False for the last pipeline stage's copy of a tied embedding (:mod:`gridshard.pipeline.tied`):
    the first stage writes the weight, the copy is equal and only read. (Under ZeRO the two
    copies sit in different units, so their element ranges — chunks — differ and must not
    both be written.)"""
    return getattr(model, "has_first", True) or name != getattr(model, "embedding_weight_name", None)


def _stepped(model: torch.nn.Module, reducer) -> list:
    """What ``reducer`` steps (:class:`gridshard.zero.stepped.SteppedTensor`), without one every parameter."""
    from ..zero.stepped import whole_parameters

    return reducer.stepped() if reducer is not None else list(whole_parameters(model))


def _stepped_blocks(model: torch.nn.Module, reducer, prefix: str, tensor_of, writing: bool) -> dict:
    """key → :class:`CanonicalBlock` of ``tensor_of(stepped)`` (the stepped tensor, or one of its
    AdamW moments; None: skipped) for every tensor ``reducer`` (:class:`gridshard.zero.
    ZeroDataParallel`) steps — the parameter itself, or under ZeRO its element range, as ≤ 3 boxes of
    the parameter's layout narrowed further —, without one every parameter (tied weights under
    their first name). fqn = ``prefix(name)``."""
    ctx, out = model.parallel_context, {}
    for s in _stepped(model, reducer):
        t = tensor_of(s)
        if t is None or (writing and not _written_once(model, s.name)):
            continue
        spec = ctx.layouts[s.name]
        for local_box, piece in s.pieces(t):
            b = canonical_block(prefix(s.name), piece, spec, ctx.mesh, local_box)
            if b is not None:
                out[block_key(b, s.elements is not None)] = b
    return out


def model_blocks(model: torch.nn.Module, reducer=None, writing: bool = False) -> dict:
    """key (:func:`block_key`) → block for every trainable parameter once (tied weights under their
    first name) of a model laid out by :func:`gridshard.parallelize`; fqn = ``"model." + name``.
    With a ZeRO ``reducer`` (:class:`gridshard.zero.ZeroDataParallel`) each data rank's blocks are
    its element ranges only (the parameter itself is not gathered under ZeRO-3). ``writing``: the
    blocks a save writes (a pipeline's second copy of a tied weight left out)."""
    return _stepped_blocks(model, reducer, lambda name: MODEL + name, lambda s: s.tensor, writing)


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


def optimizer_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer=None,
                     writing: bool = False) -> dict:
    """key → block of each AdamW moment (``optim.<param>.exp_avg`` / ``.exp_avg_sq``, the
    parameter's layout) plus ``optim.step`` (the shared step count, replicated, stored as shape [1]).
    Under a ZeRO ``reducer`` the moments are the stepped element ranges' (:func:`model_blocks`)."""
    ensure_adam_state(optimizer)
    state = lambda s: adam_state(optimizer, s.tensor) if s.tensor.numel() else None      # noqa: E731
    out = {}
    for key in ADAM_MOMENTS:
        out.update(_stepped_blocks(model, reducer, lambda name, key=key: f"{OPTIM}{name}.{key}",
                                   lambda s, key=key: (state(s) or {}).get(key), writing))
    steps = [st["step"] for s in _stepped(model, reducer) if (st := state(s))]
    if steps:
        out[OPTIM + "step"] = CanonicalBlock(OPTIM + "step", (1,), (0,), steps[-1].detach().reshape(1))
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
        self.boxes, self.keys = boxes, _keys_by_index(boxes)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, data in self.state_dict.items():
            b = self.boxes[key]
            items.append(WriteItem(
                index=MetadataIndex(b.fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=b.chunk(), properties=TensorProperties(dtype=data.dtype),
                                            size=torch.Size(b.global_size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[self.keys[(index.fqn, tuple(index.offset))]]


def _keys_by_index(boxes: dict) -> dict:
    """(fqn, offsets) → key of every block: how DCP's write and read items (indexed by the
    chunk's fqn and offsets) find a block when a fqn has several on this rank."""
    return {(b.fqn, tuple(b.offsets)): key for key, b in boxes.items()}


class BlockLoadPlanner(DefaultLoadPlanner):
    """Reads into each local block the parts of every saved chunk that overlap it."""

    def __init__(self, boxes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.keys = boxes, _keys_by_index(boxes)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for b in self.boxes.values():
            md = self.metadata.state_dict_metadata[b.fqn]
            items += create_read_items_for_chunk_list(b.fqn, md, [b.chunk()])
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[self.keys[(index.fqn, tuple(index.offset))]].view


def check_against_metadata(boxes: dict, metadata, where: str) -> None:
    """Every block has a saved tensor of its canonical size (same check on every rank, before
    any collective): a clear error naming the first mismatch."""
    saved = metadata.state_dict_metadata
    for b in boxes.values():
        fqn = b.fqn
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
