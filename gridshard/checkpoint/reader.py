"""One way to read a checkpoint: verify everything it holds, then load tensors only.

Every reader of a gridshard checkpoint goes through this module — resume
(:meth:`~gridshard.checkpoint.Checkpointer.load`), ``model.init_from`` from a gridshard
checkpoint (:meth:`~gridshard.checkpoint.Checkpointer.load_weights`), the launcher's check
before it starts workers (``gridshard train --resume``), ``gridshard generate`` and
``gridshard export`` (:func:`read_tensors`) — so a check added here holds for all of them.

:func:`open_checkpoint` reads no tensor byte; it refuses the folder unless

1. **paths** stay inside it: the folder and every entry in it are real (no symbolic links,
   :func:`gridshard.checkpoint.files.check_folder`); ``latest`` was accepted only as a plain
   ``step_N`` name (:func:`gridshard.checkpoint.files.read_latest`);
2. the **manifest** holds: every listed file (plain names only) present, of its size, with
   its sha256 (ranks may split the hashing: ``hash_share``);
3. **meta.json** is JSON of the expected shape (format, step, config.model …);
4. DCP's **.metadata** unpickles through the allow-list and every entry is a tensor
   (:func:`gridshard.checkpoint.files.read_dcp_metadata`), every chunk lies inside its tensor
   and the chunks' volume adds up to it, and every chunk's bytes lie inside a chunk file the
   manifest lists (``relative_path`` a plain name, ``offset + length`` within the file, no
   stream transforms) — DCP would otherwise open whatever path the index names;
5. **meta.json agrees with the tensors**: the model meta.json describes, built on the meta
   device (no memory), has exactly the checkpoint's ``model.*`` names and shapes — so a
   meta.json saying ``vocab_size: 300`` beside a 256-row embedding is refused rather than
   exported as a wrong ``config.json`` or loaded into a model of another size.

Then :func:`read_blocks` loads through gridshard's block planner — it asks only for tensor
chunks, and a bytes item raises — from a DCP reader that hands DCP the metadata checked
above (never re-read from disk between the check and the load) and whose tensor reads are
DCP's own ``torch.load(weights_only=True)``. So the bytes of a checkpoint are data, never
code. What this does and does not protect against: ``docs/checkpoints.md``, "Threat model".

Every refusal is one :class:`~gridshard.checkpoint.files.CheckpointError` (a ``ConfigError``:
exit status 2 from the CLI) naming the folder, what is wrong and a fix — the newest other
checkpoint that verifies, by path.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

from . import files as F
from .blocks import MODEL, BlockLoadPlanner, CanonicalBlock, check_against_metadata


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint folder that passed :func:`open_checkpoint`: its ``meta.json`` and DCP's
    metadata (tensor entries only, chunks located in files of the manifest)."""

    folder: str
    meta: dict
    metadata: object
    manifest: dict

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.folder))

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def open_checkpoint(folder: str, hash_share: tuple = (0, 1), group=None) -> VerifiedCheckpoint:
    """Verify ``folder`` completely (module docstring) without reading a tensor.

    ``hash_share = (rank, world)``: this process hashes the manifest's files
    ``i ≡ rank (mod world)`` (default: all; world 0: none — sizes only). With ``group`` (every
    rank of it calls this) the ranks agree: each verdict is gathered and every rank raises
    the same CheckpointError — its advice composed once, on the group's first rank — or
    none does."""
    problem, checked = None, None
    try:
        checked = _check(folder, hash_share)
    except F.Refused as r:
        problem = (r.what, r.fix)
    if group is None:
        if problem:
            raise F.refusal(folder, *problem)
        return checked
    import torch.distributed as dist

    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, problem, group=group)
    first = next((v for v in verdicts if v), None)
    if first is None:
        return checked
    message = [str(F.refusal(folder, *first)) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    raise F.CheckpointError(message[0])


def _check(folder: str, hash_share: tuple) -> VerifiedCheckpoint:
    manifest = F._verify(folder, hash_share)          # 1 + 2: paths, manifest (sizes, sha256)
    meta = F._read_meta(folder)                       # 3
    metadata = F.read_dcp_metadata(folder)            # 4: allow-list, tensors only
    try:
        _check_chunks(metadata, manifest)             # 4: chunks inside tensors and files
    except (AttributeError, TypeError, ValueError) as e:    # an allowed class built with missing/odd fields
        raise F.Refused(f".metadata is malformed ({type(e).__name__}: {str(e)[:120]})") from None
    _check_meta_against_tensors(meta, metadata)       # 5
    return VerifiedCheckpoint(folder, meta, metadata, manifest)


def _ints(seq, what: str) -> tuple:
    try:
        out = tuple(seq)
    except TypeError:
        raise F.Refused(f".metadata: {what} is not a sequence of integers") from None
    if not all(type(x) is int and x >= 0 for x in out):
        raise F.Refused(f".metadata: {what} is not a sequence of non-negative integers")
    return out


def _check_chunks(metadata, manifest: dict) -> None:
    """Step 4 of the module docstring, after the allow-list: where every byte DCP will read
    comes from. (Chunks are not checked for overlaps — DCP writes each element once — only
    for bounds and total volume; a full read starts from zeros, never from uninitialised
    memory.)"""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    files = manifest["files"]
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise F.Refused(".metadata has no index of where the chunks are stored")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise F.Refused(".metadata's storage index holds an entry that is not a chunk location")
        if index.fqn not in metadata.state_dict_metadata:
            raise F.Refused(f".metadata stores a chunk of {str(index.fqn)[:80]!r}, which is no tensor of it")
        name = info.relative_path
        if not F._plain_name(name) or name in (F.META, F.MANIFEST, ".metadata") or name not in files:
            shown = repr(name[:80]) if isinstance(name, str) else "(not a name)"
            raise F.Refused(f".metadata places a chunk of {index.fqn[:80]!r} in {shown}, which is not a chunk file "
                            f"of the folder listed in {F.MANIFEST}")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 \
                or info.offset + info.length > files[name]["bytes"]:
            raise F.Refused(f".metadata places a chunk of {index.fqn[:80]!r} outside the bytes of {name}")
        if info.transform_descriptors:
            raise F.Refused(f".metadata asks for stream transforms on a chunk of {index.fqn[:80]!r}; gridshard "
                            f"writes none")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise F.Refused(".metadata names a tensor by something that is not a string")
        size = _ints(md.size, f"the size of {fqn[:80]!r}")
        if not isinstance(getattr(md.properties, "dtype", None), torch.dtype):
            raise F.Refused(f".metadata: {fqn[:80]!r} has no torch dtype")
        if not isinstance(md.chunks, list):
            raise F.Refused(f".metadata: {fqn[:80]!r} has no list of chunks")
        volume = 0
        for c in md.chunks:
            if not isinstance(c, ChunkStorageMetadata):
                raise F.Refused(f".metadata: a chunk of {fqn[:80]!r} is not a chunk description")
            offsets = _ints(c.offsets, f"a chunk offset of {fqn[:80]!r}")
            sizes = _ints(c.sizes, f"a chunk size of {fqn[:80]!r}")
            if len(offsets) != len(size) or len(sizes) != len(size) or \
                    any(o + n > s for o, n, s in zip(offsets, sizes, size)):
                raise F.Refused(f".metadata: a chunk of {fqn[:80]!r} lies outside its size {size}")
            if MetadataIndex(fqn, offsets) not in storage:
                raise F.Refused(f".metadata: the chunk of {fqn[:80]!r} at {offsets} is stored nowhere")
            volume += math.prod(sizes)
        if volume != math.prod(size):
            raise F.Refused(f".metadata: the chunks of {fqn[:80]!r} hold {volume} of its {math.prod(size)} elements")


def _check_meta_against_tensors(meta: dict, metadata) -> None:
    """Step 5 of the module docstring: the shapes ``meta.json``'s model section gives every
    parameter (the model built from it on the meta device: the same code that builds the
    training model, so no shape rule is written twice) equal the checkpoint's tensors. A
    model trained from ``model.hf_config`` is stored under Hugging Face names: those are
    renamed, and tensors the gridshard model lacks (e.g. Qwen2's q/k/v biases) are allowed. The
    model's persistent buffers (an MoE router's balancing bias) may be held, at their shapes; a
    checkpoint written before they were saved lacks them."""
    from ..models.hf import hf_to_gridshard_name
    from ..models.llama import Transformer
    from ..models.vit import VisionTransformer, saved_model_config

    model = meta["config"]["model"]
    vit = model.get("kind") == "vit"               # a ViT (model.kind: vit); older checkpoints have no kind
    try:
        with torch.device("meta"):
            plain = (VisionTransformer if vit else Transformer)(saved_model_config(model))
    except Exception as e:     # noqa: BLE001 - any field of any type may be edited
        raise F.Refused(f"{F.META}'s model section does not describe a model ({type(e).__name__}: {str(e)[:120]})") \
            from None
    expected = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    buffers = {n: tuple(b.shape) for n, b in plain.state_dict(keep_vars=True).items() if n not in expected}
    hf = bool(model.get("hf_config"))
    rename = hf_to_gridshard_name if hf else (lambda name: name)
    saved = {rename(fqn[len(MODEL):]): tuple(md.size) for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith(MODEL)}
    short = ", ".join(f"{k}={model[k]!r}" for k in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                                                         "ffn_hidden", "tie_embeddings") if k in model)
    for name, shape in expected.items():
        if name not in saved:
            raise F.Refused(f"{F.META} describes a model ({short}) with the parameter {name!r}, which the "
                            f"checkpoint does not hold (meta.json does not belong to these tensors)")
        if saved[name] != shape:
            raise F.Refused(f"{F.META} describes a model ({short}) whose {name!r} has shape {shape}, but the "
                            f"checkpoint's tensor has shape {saved[name]} (meta.json does not belong to these "
                            f"tensors)")
    extra = sorted(n for n in set(saved) - set(expected) if buffers.get(n) != saved[n])   # a buffer: at its shape
    if extra and not hf:
        raise F.Refused(f"the checkpoint holds {MODEL}{extra[0][:80]}, which the model {F.META} describes ({short}) "
                        f"does not have (meta.json does not belong to these tensors)")


class _TensorOnlyPlanner(BlockLoadPlanner):
    """gridshard's block planner (tensor read items only) that refuses a bytes item outright:
    DCP's default ``load_bytes`` is ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item, value) -> None:
        raise _not_a_tensor(read_item.dest_index.fqn)


def _not_a_tensor(fqn) -> F.CheckpointError:
    return F.CheckpointError(f"checkpoint entry {fqn!r} is not a tensor; gridshard loads tensors only. Fix: use a "
                             f"checkpoint written by gridshard.")


class _CheckedReader(F.SafeMetadataReader):
    """DCP's file reader over a :class:`VerifiedCheckpoint`: ``read_metadata`` returns the
    metadata :func:`open_checkpoint` checked (not a second read of the file, which could have
    changed since), and ``read_data`` refuses any item that is not a tensor before DCP reads
    a byte. Tensor items are DCP's ``torch.load(weights_only=True)``."""

    def __init__(self, checked: VerifiedCheckpoint):
        super().__init__(checked.folder)
        self._metadata = checked.metadata

    def read_metadata(self, *args, **kwargs):
        return self._with_load_id(self._metadata)

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise _not_a_tensor(item.dest_index.fqn)
        return super().read_data(plan, planner)


def read_blocks(checked: VerifiedCheckpoint, boxes: dict, group=None) -> None:
    """Read into every :class:`~gridshard.checkpoint.blocks.CanonicalBlock` of ``boxes`` its
    box of the saved tensor (any layout: DCP computes the overlaps with the saved chunks).
    With ``group`` every rank of it calls this (DCP plans collectively); without, one process.
    A block that has no saved tensor of its canonical size is a LayoutError before anything
    is read; a chunk whose bytes do not decode as the tensor .metadata promises is a
    CheckpointError (the blocks are then partly overwritten: the caller discards them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_against_metadata(boxes, checked.metadata, checked.name)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)      # DCP: "assuming the intent is to load in a single process"
            dcp.load({k: b.view for k, b in boxes.items()}, storage_reader=_CheckedReader(checked),
                     planner=_TensorOnlyPlanner(boxes), process_group=group, no_dist=group is None)
    except F.CheckpointError:
        raise
    except (Exception, CheckpointException) as e:     # noqa: BLE001 - CheckpointException is a BaseException
        cause = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))[0]
            if isinstance(cause, F.CheckpointError):
                raise F.CheckpointError(str(cause)) from None
        line = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
        raise F.CheckpointError(f"checkpoint {checked.name} at {checked.folder!r}: its chunk data does not match its "
                                f".metadata ({line}). Fix: use another checkpoint (this one was written by something "
                                f"other than gridshard, or damaged and re-manifested).") from None


def read_tensors(checked: VerifiedCheckpoint, prefix: str = MODEL) -> dict:
    """name (``prefix`` removed) → the whole canonical tensor of every entry whose key starts
    with ``prefix`` (one process, no process group; whatever layout wrote it)."""
    full = {}
    for fqn, md in checked.metadata.state_dict_metadata.items():
        if fqn.startswith(prefix):
            size = tuple(md.size)
            full[fqn] = CanonicalBlock(fqn, size, (0,) * len(size), torch.zeros(size, dtype=md.properties.dtype))
    read_blocks(checked, full)
    return {k[len(prefix):]: b.view for k, b in full.items()}


def read_checkpoint(folder: str, prefix: str = MODEL) -> tuple:
    """(:class:`VerifiedCheckpoint`, :func:`read_tensors`) of ``folder``: what ``gridshard
    generate`` and ``gridshard export`` use."""
    checked = open_checkpoint(folder)
    return checked, read_tensors(checked, prefix)
