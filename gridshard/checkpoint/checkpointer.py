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

What is never published: a checkpoint whose staged blocks (weights, AdamW moments) hold a
NaN/inf — each rank checks its CPU copies in the save thread (one pass over bytes the save
copies anyway) and rank 0 publishes only when every rank's are finite (``meta.json`` then
records ``weights_finite: true``); otherwise the partial folder is removed and every rank's
``wait()`` raises :class:`~gridshard.errors.NonFiniteError`. So ``latest`` always names a
finite checkpoint. A save that cannot be written (full disk, read-only file system, no
permission; DCP's multi-rank error or torch's "unexpected pos" short write) has its partial
folder removed, the previous checkpoints untouched, and every rank's ``wait()`` raises
:class:`~gridshard.errors.SaveError` with one line from :func:`gridshard.disk.write_failure`:
``run dir R is full: 1.2 MB free, a checkpoint needs ~1.7 MB; checkpoint step_3 was not saved
(its partial folder was removed); last complete checkpoint: R/checkpoints/step_2. Fix: …``.
The training thread meets the error at its next ``wait()``: the next save, a stop, or the end
of the run.

Loading (:meth:`Checkpointer.load`; :meth:`Checkpointer.load_weights` for ``model.init_from``)
goes through :mod:`gridshard.checkpoint.reader`: it verifies the checkpoint completely —
manifest (ranks split the hashing and agree on the verdict through one gather, so every rank
raises the same error), ``meta.json`` against the tensors, DCP's index (tensors only, chunks
inside the folder's files) — checks every block against DCP's metadata, then reads exactly
this rank's blocks: the layout that reads may differ from the one that wrote.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
from concurrent.futures import Future
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..disk import disk_errno, one_line, write_failure
from ..errors import NonFiniteError, SaveError
from . import files as F
from .blocks import (BlockSavePlanner, CanonicalBlock, buffer_blocks, model_blocks,
                     optimizer_blocks, set_optimizer_step, staged_copy)
from .faults import FaultPlan, hit
from .reader import open_checkpoint, read_blocks


def _saved_buffers(model, checked) -> dict:
    """:func:`buffer_blocks` the checkpoint holds: one written before buffers were saved has none, and
    the buffers keep their starting values (an MoE bias, then only ever zero)."""
    return {k: b for k, b in buffer_blocks(model).items() if k in checked.metadata.state_dict_metadata}


def rng_blocks(rank: int, device: torch.device) -> dict:
    """This rank's generator states as uint8 tensors (CPU, and CUDA when training on it)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {f"rng.{k}.rank_{rank}": CanonicalBlock(f"rng.{k}.rank_{rank}", tuple(v.shape), (0,), v.clone())
            for k, v in states.items()}


def first_nonfinite(staged: dict) -> Optional[str]:
    """The first staged block holding NaN/inf (floating blocks only), else None."""
    return next((key for key, t in staged.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())),
                None)


def _checkpoint_bytes(folder: Optional[str]) -> Optional[int]:
    """Bytes of a complete checkpoint (its manifest's sizes), None when unknown (or no folder)."""
    try:
        return sum(int(v["bytes"]) for v in F._read_manifest(folder)["files"].values()) or None
    except Exception:                                   # noqa: BLE001 (an estimate only; folder None included)
        return None


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
        self.last_requested: Optional[int] = None     # newest step a save was started for
        if self.root and self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            F.remove_partials(self.root)             # a save killed in an earlier attempt
        if self.group is not None:
            dist.barrier(group=self.group)

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, meta: dict, blocking: bool = False, reducer=None) -> None:
        """Checkpoint ``step``: stage this rank's blocks, then write and publish them in the
        background (``blocking``: wait for it). ``meta``: the JSON fields of ``meta.json``.
        ``reducer``: the run's :class:`gridshard.zero.ZeroDataParallel` (blocks are what it steps)."""
        if self.root is None:
            return
        self.wait()
        self.last_requested = step
        hit(self.faults, "save_start", self.rank, step)
        boxes = {**model_blocks(model, reducer, writing=True), **buffer_blocks(model),
                 **optimizer_blocks(model, optimizer, reducer, writing=True),
                 **rng_blocks(self.rank, next(model.parameters()).device)}
        staged = staged_copy(boxes)
        meta = {**meta, "format": F.FORMAT, "step": step, "world_size": self.world}
        fut: Future = Future()
        thread = threading.Thread(target=self._write, args=(fut, step, staged, boxes, meta), daemon=True,
                                  name=f"gridshard-save-{step}")
        thread.start()
        self._in_flight = fut
        if blocking:
            self.wait()

    def _write(self, fut: Future, step: int, staged: dict, boxes: dict, meta: dict) -> None:
        """The background half of a save (module docstring). Every rank takes the same path
        through the collectives on ``self.group`` — DCP's own (a rank's write error reaches every
        rank through them), one gather of each rank's (hashed files, first non-finite block,
        error) to rank 0, one broadcast of rank 0's verdict — so every rank's ``wait()`` raises
        the same one-line error, or none."""
        final = os.path.join(self.root, F.step_dir_name(step))
        partial = final + F.PARTIAL
        try:
            error, mine, bad = None, {}, None
            try:
                dcp.save(staged, storage_writer=_FaultAwareWriter(partial, self.faults, self.rank, step),
                         planner=BlockSavePlanner(boxes), process_group=self.group, no_dist=self.group is None)
                # each rank hashes the chunk files it wrote (DCP names them __<rank>_<i>.distcp), so
                # the manifest costs rank 0 only .metadata and meta.json, not the whole checkpoint
                mine = F.describe_files(partial, prefix=f"__{self.rank}_")
                bad = first_nonfinite(staged)          # the copies are on the CPU already: one pass
            except BaseException as e:                 # noqa: BLE001 (DCP's CheckpointException is one)
                error = e
            nbytes = sum(t.numel() * t.element_size() for t in staged.values())
            report = (mine, bad, *((disk_errno(error), one_line(error)) if error is not None else (None, None)), nbytes)
            reports = [report]
            if self.group is not None:
                reports = [None] * self.world if self.rank == 0 else None
                dist.gather_object(report, reports, dst=0, group=self.group)
            verdict = None                             # rank 0's: None (published) or (kind, one line)
            if self.rank == 0:
                verdict = self._decide(step, partial, final, meta, reports, error)
            if self.group is not None:
                box = [verdict]
                dist.broadcast_object_list(box, src=0, group=self.group)
                verdict = box[0]
            if verdict is None:
                fut.set_result(step)
            else:
                kind, line = verdict
                failure = (NonFiniteError if kind == "nonfinite" else SaveError)(line)
                failure.__cause__ = error
                fut.set_exception(failure)
        except BaseException as e:                     # noqa: BLE001 (reported by wait())
            fut.set_exception(e)

    def _decide(self, step: int, partial: str, final: str, meta: dict, reports: list, error) -> Optional[tuple]:
        """Rank 0: publish the save when every rank wrote its data and every staged block is
        finite; otherwise (or when publishing fails) remove what is left of it and return
        (kind, one line): ``("save", …)`` a write failed — a full, read-only or forbidden disk
        named as such (:mod:`gridshard.disk`) —, ``("nonfinite", …)`` NaN/inf weights or optimizer
        state, never published (so ``latest`` always names a finite checkpoint)."""
        failed = [(r, code, line) for r, (_, _, code, line, _) in enumerate(reports) if line]
        bad = [(r, key) for r, (_, key, _, _, _) in enumerate(reports) if key]
        staged_bytes = sum(x[4] for x in reports)
        if failed:
            rank, code, line = next(((r, c, x) for r, c, x in failed if c is not None), failed[0])
            cause = error if rank == 0 and error is not None else (OSError(code, os.strerror(code)) if code else None)
            return "save", self._failure_line(step, partial, final, cause, line, staged_bytes)
        if bad:
            removed = self._remove_partial(partial)
            rank, key = bad[0]
            return "nonfinite", (f"checkpoint {F.step_dir_name(step)} refused: its block {key} (rank {rank}) holds "
                                 f"NaN/inf values, so the run had diverged by step {step}; {removed}; last finite "
                                 f"checkpoint: {self.latest() or 'none was written'}. Fix: lower "
                                 f"train.lr (or train.grad_clip) and continue from that checkpoint, or start again; "
                                 f"train.on_nonfinite (stop | skip) acts on the first non-finite gradient norm.")
        try:
            self._publish(step, partial, final, {**meta, "weights_finite": True},
                          {k: v for d in reports for k, v in d[0].items()})
        except BaseException as e:                     # noqa: BLE001 (the same error on every rank)
            return "save", self._failure_line(step, partial, final, e, one_line(e), staged_bytes)
        return None

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

    def latest(self) -> Optional[str]:
        """The checkpoint ``latest`` names (for messages; None when there is none or it is unusable)."""
        return F.latest_or_none(self.root)

    def _remove_partial(self, partial: str) -> str:
        """Remove a save's partial folder (and a ``latest.tmp``); what happened, for the message."""
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.root, F.LATEST + ".tmp"))
        if not os.path.exists(partial):
            return "nothing of it is left"
        shutil.rmtree(partial, ignore_errors=True)
        if os.path.exists(partial):
            return f"its partial folder {partial} could not be removed (the next run in this directory removes it)"
        return "its partial folder was removed"

    def _failure_line(self, step: int, partial: str, final: str, cause, line: str, staged_bytes: int) -> str:
        """One line for a save that failed (module :mod:`gridshard.disk` for disk errors)."""
        removed = self._remove_partial(partial)
        name = F.step_dir_name(step)
        last = self.latest()
        if not os.path.isdir(final):
            lost = f"checkpoint {name} was not saved ({removed})"
        elif last is not None and os.path.normpath(last) == os.path.normpath(final):
            lost = f"checkpoint {name} was saved, what follows its publication failed ({line})"
        else:
            lost = f"checkpoint {name} is complete but `latest` was not moved to it ({line})"
        need = _checkpoint_bytes(last) or staged_bytes
        return (write_failure(os.path.dirname(self.root), self.root, cause, lost, need=need, last=last)
                or f"saving checkpoint {name} failed: {line}; {lost}; "
                   f"{'last complete checkpoint: ' + last if last else 'no complete checkpoint was written'}.")

    def wait(self) -> None:
        """Wait for the save in flight (if any); re-raise its error."""
        fut, self._in_flight = self._in_flight, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    # ---- load (every read goes through gridshard.checkpoint.reader) ----------------------
    # each first verifies ``folder`` completely on every rank (gridshard.checkpoint.reader.open_checkpoint:
    # ranks split the hashing and agree), or raises the same CheckpointError on every rank
    def load_weights(self, folder: str, model) -> dict:
        """``model.init_from`` a gridshard checkpoint: verify ``folder`` and read this rank's
        blocks of the model's parameters only — no optimizer (it need not exist yet), no
        generator states, no step. Any layout reads any checkpoint. Returns ``meta.json``."""
        checked = open_checkpoint(folder, (self.rank, self.world), self.group)
        read_blocks(checked, {**model_blocks(model), **_saved_buffers(model, checked)}, self.group)
        return checked.meta

    def load(self, folder: str, model, optimizer, load_optimizer: bool = True, reducer=None) -> dict:
        """Read ``folder`` into this rank's blocks of ``model`` (and ``optimizer``); restore the
        generator states when the world size is the one that wrote it. Returns ``meta.json``."""
        checked = open_checkpoint(folder, (self.rank, self.world), self.group)
        meta = checked.meta
        boxes = {**model_blocks(model, reducer), **_saved_buffers(model, checked)}
        if load_optimizer:
            boxes.update(optimizer_blocks(model, optimizer, reducer))
        device = next(model.parameters()).device
        rng = rng_blocks(self.rank, device) if meta.get("world_size") == self.world else {}
        rng = {k: v for k, v in rng.items() if k in checked.metadata.state_dict_metadata}
        boxes.update(rng)
        read_blocks(checked, boxes, self.group)
        if load_optimizer and "optim.step" in boxes:
            set_optimizer_step(optimizer, boxes["optim.step"].view)
        if rng:
            restore_rng(rng, self.rank, device)
        if reducer is not None:
            reducer.after_step()                       # ZeRO-1/2: every rank's rows into the whole block
        return meta
