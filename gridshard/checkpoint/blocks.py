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
tensor, keyed ``fqn@offsets`` (:func:`model_blocks`). The saved chunks of one tensor are disjoint
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

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import LayoutError
from ..nn.sharding import mesh_coords

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
    their first name). fqn = ``prefix(name)``.

    Each piece (the stored block, or with ``local_box`` = ((lo, hi) per stored dim) that box of it,
    ``piece`` then in the box's shape: a piece of a ZeRO element range) is the box of its canonical
    tensor :meth:`~gridshard.nn.sharding.ShardSpec.canonical_box` gives — none when it holds only padding. Its key in a
    rank's dict of blocks (and in DCP's state dict): the fqn, or for a piece of an element range —
    a parameter may have several on one rank — ``fqn@offsets``."""
    ctx, out = model.parallel_context, {}
    coords = mesh_coords(ctx.mesh)
    for s in _stepped(model, reducer):
        t = tensor_of(s)
        if t is None or (writing and not _written_once(model, s.name)):
            continue
        spec = ctx.layouts[s.name]
        for local_box, piece in s.pieces(t):
            box = spec.canonical_box(*coords, local_box=local_box)
            if box is None:
                continue
            fqn, offsets = prefix(s.name), tuple(o for o, _ in box)
            key = f"{fqn}@{','.join(map(str, offsets))}" if s.elements is not None else fqn
            out[key] = CanonicalBlock(fqn, tuple(spec.canonical()), offsets, spec.canonical_view(piece.detach(), box))
    return out


def model_blocks(model: torch.nn.Module, reducer=None, writing: bool = False) -> dict:
    """key (:func:`_stepped_blocks`) → block for every trainable parameter once (tied weights under their
    first name) of a model laid out by :func:`gridshard.parallelize`; fqn = ``"model." + name``.
    With a ZeRO ``reducer`` (:class:`gridshard.zero.ZeroDataParallel`) each data rank's blocks are
    its element ranges only (the parameter itself is not gathered under ZeRO-3). ``writing``: the
    blocks a save writes (a pipeline's second copy of a tied weight left out)."""
    return _stepped_blocks(model, reducer, lambda name: MODEL + name, lambda s: s.tensor, writing)


def buffer_blocks(model: torch.nn.Module) -> dict:
    """key → block of every persistent buffer of ``model`` (an MoE router's balancing bias), held
    whole and equal on every rank that has it (DCP writes it once), fqn ``"model." + name``."""
    params = {id(p) for p in model.parameters()}
    return {MODEL + name: CanonicalBlock(MODEL + name, tuple(b.shape), (0,) * b.dim(), b)
            for name, b in model.state_dict(keep_vars=True).items() if id(b) not in params}


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW state (zero moments, step 0) if it has none yet, in the
    form ``torch.optim.AdamW`` itself creates on its first step, so a checkpoint can be read
    into it before any step."""
    inner = getattr(optimizer, "inner", None)          # host-memory AdamW (gridshard.zero.offload)
    if inner is not None:
        return ensure_adam_state(inner)
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))      # else the step count is on the CPU
        moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                st.update({m: torch.zeros_like(p, memory_format=torch.preserve_format) for m in moments})


def optimizer_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer=None,
                     writing: bool = False) -> dict:
    """key → block of each AdamW moment (``optim.<param>.exp_avg`` / ``.exp_avg_sq``, the
    parameter's layout) plus ``optim.step`` (the shared step count, replicated, stored as shape [1]).
    Under a ZeRO ``reducer`` the moments are the stepped element ranges' (:func:`model_blocks`)."""
    ensure_adam_state(optimizer)
    lookup = getattr(optimizer, "state_for", None) or optimizer.state.get    # state_for: kept elsewhere (host memory)
    state = lambda s: lookup(s.tensor) if s.tensor.numel() else None      # noqa: E731
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


class _ByBlock:
    """A DCP planner over ``boxes`` (key → :class:`CanonicalBlock`); ``_key(index)``: the key of the
    block that DCP's write or read item (indexed by the chunk's fqn and offsets) stands for, also
    when a fqn has several blocks on this rank."""

    def __init__(self, boxes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.keys = boxes, {(b.fqn, tuple(b.offsets)): key for key, b in boxes.items()}

    def _key(self, index: MetadataIndex) -> str:
        return self.keys[(index.fqn, tuple(index.offset))]


class BlockSavePlanner(_ByBlock, DefaultSavePlanner):
    """Writes each staged block as one chunk at its offsets (module docstring).

    ``state_dict`` (what DCP stages and passes in) maps fqn → the block's data;
    ``boxes`` maps fqn → :class:`CanonicalBlock` (offsets and global size)."""

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
        return self.state_dict[self._key(index)]


class BlockLoadPlanner(_ByBlock, DefaultLoadPlanner):
    """Reads into each local block the parts of every saved chunk that overlap it."""

    def create_local_plan(self) -> LoadPlan:
        items = []
        for b in self.boxes.values():
            md = self.metadata.state_dict_metadata[b.fqn]
            items += create_read_items_for_chunk_list(b.fqn, md, [b.chunk()])
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[self._key(index)].view


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
