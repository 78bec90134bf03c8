"""Save and load a training run's state: sharded, asynchronous, atomic, reshardable.

What a checkpoint holds (``step_N/``, see :mod:`gridshard.checkpoint.files` for the folder):

* DCP chunks, canonical layout (:mod:`gridshard.checkpoint.blocks`):
  ``model.<name>`` every trainable parameter once (tied weights under their first name),
  ``optim.<name>.exp_avg`` / ``.exp_avg_sq`` (AdamW moments, the parameter's layout),
  ``optim.step``, and ``rng.<device>.rank_<r>`` (each rank's generator state);
* ``meta.json``: ``step``, ``tokens`` (= step·G·s), ``samples`` (= step·G, the data
  position as a global sample count: batches are a function of (seed, step), so it is valid
  at any D), the loss-scaler state, the layout that wrote it and the resolved config.

Saving (:meth:`Checkpointer.save`) copies this rank's blocks to CPU memory on the training
thread — the only part training waits for — then a background thread runs
``torch.distributed.checkpoint.save`` on a dedicated gloo process group (collectives from a
second thread on the training group could interleave with the training collectives and
hang), hashes the chunk files this rank wrote and, on rank 0, publishes the folder (meta,
manifest, rename, ``latest``, prune). At
most one save is in flight: the next one first waits for it. This is DCP's ``async_save``
split in two so that publishing happens in the same background thread, right after the
data is complete, not at the next save.

Loading (:meth:`Checkpointer.load`) verifies the manifest (ranks split the hashing and agree
on the verdict through one gather, so every rank raises the same error), checks every
block against DCP's metadata, then reads exactly this rank's blocks: the layout that reads
may differ from the one that wrote.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from . import files as F
from .blocks import (BlockLoadPlanner, BlockSavePlanner, CanonicalBlock, check_against_metadata, model_blocks,
                     optimizer_blocks, set_optimizer_step, staged_copy)
from .faults import FaultPlan, hit


def rng_blocks(rank: int, device: torch.device) -> dict:
    """This rank's generator states as uint8 tensors (CPU, and CUDA when training on it)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {f"rng.{k}.rank_{rank}": CanonicalBlock(f"rng.{k}.rank_{rank}", tuple(v.shape), (0,), v.clone())
            for k, v in states.items()}


def restore_rng(blocks: dict, rank: int, device: torch.device) -> None:
    torch.set_rng_state(blocks[f"rng.cpu.rank_{rank}"].view)
    if device.type == "cuda" and f"rng.cuda.rank_{rank}" in blocks:
        torch.cuda.set_rng_state(blocks[f"rng.cuda.rank_{rank}"].view, device)


class _FaultAwareWriter(FileSystemWriter):
    """DCP's file writer, with the ``save_after_data`` fault point once this rank's chunks
    are on disk (tests only; see :mod:`gridshard.checkpoint.faults`)."""

    def __init__(self, path, faults: Optional[FaultPlan], rank: int, step: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self._faults, self._rank, self._step = faults, rank, step

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        hit(self._faults, "save_after_data", self._rank, self._step)
        return fut


class Checkpointer:
    """Checkpoints of one run under ``RUN_DIR/checkpoints`` (module docstring).

    Collective: construct it, :meth:`save` and :meth:`load` on every rank of the job."""

    def __init__(self, run_dir: Optional[str], keep: int = 3, faults: Optional[FaultPlan] = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.root = F.checkpoints_root(run_dir) if run_dir else None
        self.keep, self.faults = keep, faults
        # a gloo group of its own: DCP's collectives run on the save thread (module docstring)
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._in_flight: Optional[Future] = None
        self.last_saved: Optional[int] = None         # newest step whose save completed
        self.last_requested: Optional[int] = None     # newest step a save was started for
        self.save_seconds: list = []                  # time the training thread spent per save
        if self.root and self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            F.remove_partials(self.root)             # a save killed in an earlier attempt
        self._barrier()

    def _barrier(self):
        if self.group is not None:
            dist.barrier(group=self.group)

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, meta: dict, blocking: bool = False, zero=None) -> None:
        """Checkpoint ``step``: stage this rank's blocks, then write and publish them in the
        background (``blocking``: wait for it). ``meta``: the JSON fields of ``meta.json``.
        ``zero``: the run's :class:`gridshard.zero.ZeroDataParallel` (blocks are its shards)."""
        if self.root is None:
            return
        self.wait()
        self.last_requested = step
        t0 = time.perf_counter()
        hit(self.faults, "save_start", self.rank, step)
        boxes = {**model_blocks(model, zero), **optimizer_blocks(model, optimizer, zero),
                 **rng_blocks(self.rank, next(model.parameters()).device)}
        staged = staged_copy(boxes)
        meta = {**meta, "format": F.FORMAT, "step": step, "world_size": self.world}
        fut: Future = Future()
        thread = threading.Thread(target=self._write, args=(fut, step, staged, boxes, meta), daemon=True,
                                  name=f"gridshard-save-{step}")
        thread.start()
        self._in_flight = fut
        self.save_seconds.append(time.perf_counter() - t0)
        if blocking:
            self.wait()

    def _write(self, fut: Future, step: int, staged: dict, boxes: dict, meta: dict) -> None:
        final = os.path.join(self.root, F.step_dir_name(step))
        partial = final + F.PARTIAL
        try:
            dcp.save(staged, storage_writer=_FaultAwareWriter(partial, self.faults, self.rank, step),
                     planner=BlockSavePlanner(boxes), process_group=self.group, no_dist=self.group is None)
            # each rank hashes the chunk files it wrote (DCP names them __<rank>_<i>.distcp), so
            # the manifest costs rank 0 only .metadata and meta.json, not the whole checkpoint
            mine = F.describe_files(partial, prefix=f"__{self.rank}_")
            hashed = [mine]
            if self.group is not None:
                hashed = [None] * self.world if self.rank == 0 else None
                dist.gather_object(mine, hashed, dst=0, group=self.group)
            if self.rank == 0:
                self._publish(step, partial, final, meta, {k: v for d in hashed for k, v in d.items()})
            fut.set_result(step)
        except BaseException as e:                     # noqa: BLE001 (reported by wait())
            fut.set_exception(e)

    def _publish(self, step: int, partial: str, final: str, meta: dict, hashed: dict) -> None:
        hit(self.faults, "save_after_metadata", self.rank, step)
        F.write_json(os.path.join(partial, F.META), meta)
        F.write_manifest(partial, hashed)
        F.fsync_dir(partial)
        hit(self.faults, "save_after_manifest", self.rank, step)
        F.publish(partial, final)
        hit(self.faults, "save_after_rename", self.rank, step)
        F.update_latest(self.root, F.step_dir_name(step))
        hit(self.faults, "save_after_latest", self.rank, step)
        F.prune(self.root, self.keep)

    def wait(self) -> None:
        """Wait for the save in flight (if any); re-raise its error."""
        fut, self._in_flight = self._in_flight, None
        if fut is not None:
            self.last_saved = fut.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    # ---- load ----------------------------------------------------------------------------
    def verify(self, folder: str) -> dict:
        """Verify ``folder`` on every rank (ranks split the hashing) and agree: returns its
        ``meta.json``, or raises the same CheckpointError on every rank."""
        error = None
        try:
            F.verify_checkpoint(folder, (self.rank, self.world))
        except F.CheckpointError as e:
            error = str(e)
        errors = [error]
        if self.group is not None:
            errors = [None] * self.world
            dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e), None)
        if first:
            raise F.CheckpointError(first)
        return F.read_meta(folder)

    def load(self, folder: str, model, optimizer, load_optimizer: bool = True, zero=None) -> dict:
        """Read ``folder`` into this rank's blocks of ``model`` (and ``optimizer``); restore the
        generator states when the world size is the one that wrote it. Returns ``meta.json``."""
        meta = self.verify(folder)
        reader = F.SafeMetadataReader(folder)
        metadata = reader.read_metadata()
        boxes = dict(model_blocks(model, zero))
        if load_optimizer:
            boxes.update(optimizer_blocks(model, optimizer, zero))
        device = next(model.parameters()).device
        rng = rng_blocks(self.rank, device) if meta.get("world_size") == self.world else {}
        rng = {k: v for k, v in rng.items() if k in metadata.state_dict_metadata}
        check_against_metadata(boxes, metadata, F.step_dir_name(meta["step"]))
        boxes.update(rng)
        with torch.no_grad():
            dcp.load({k: b.view for k, b in boxes.items()}, storage_reader=F.SafeMetadataReader(folder),
                     planner=BlockLoadPlanner(boxes), process_group=self.group, no_dist=self.group is None)
        if load_optimizer and "optim.step" in boxes:
            set_optimizer_step(optimizer, boxes["optim.step"].view)
        if rng:
            restore_rng(rng, self.rank, device)
        if zero is not None:
            zero.after_step()                          # ZeRO-1/2: every rank's rows into the whole block
        return meta
