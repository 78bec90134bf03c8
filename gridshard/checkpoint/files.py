"""The checkpoint folder on disk: names, the ``latest`` pointer, the manifest, verification.

::

    RUN_DIR/checkpoints/
        step_20/                 complete checkpoints only
            .metadata            DCP's index of chunks (read through an allow-list, below)
            __0_0.distcp …       each rank's chunks (DCP files)
            meta.json            step, tokens, data position, scaler, layout, resolved config
            manifest.json        every file above: size and sha256 — written last
        step_30/
        step_40.partial/         a save in progress (or killed): never read
        latest                   "step_30": the newest complete checkpoint, replaced atomically

Visibility rule: a save writes into ``step_N.partial/``; when every rank's data and DCP's
``.metadata`` are on disk, rank 0 writes ``meta.json`` and then ``manifest.json``, fsyncs,
renames the folder to ``step_N`` and only then replaces ``latest`` (write ``latest.tmp``,
``os.replace``). A crash at any point therefore leaves either no ``step_N`` or a complete
one, and ``latest`` never names an incomplete folder. Loading verifies the manifest first
(every file present, of its size, with its hash) and refuses with a message naming the step,
the file and what is wrong — never a partial load.

Nothing in a checkpoint is unpickled freely: tensors are read by DCP with
``torch.load(weights_only=True)``, ``meta.json``/``manifest.json`` are JSON, and DCP's
``.metadata`` pickle goes through :class:`SafeMetadataReader`, whose unpickler only builds
DCP's own metadata classes (an allow-list, like ``weights_only``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from typing import Optional

from torch.distributed.checkpoint import FileSystemReader

from .. import errors
from ..errors import ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(errors.CheckpointError, ConfigError):
    """A checkpoint that cannot be used: missing, incomplete, damaged or incompatible. It is
    ``gridshard.CheckpointError`` and, refused before any worker starts, a ``ConfigError``
    (exit status 2)."""


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def complete_steps(root: str) -> list:
    """Steps with a complete-looking folder (named ``step_N`` and holding a manifest), sorted."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


def read_latest(root: str) -> Optional[str]:
    """The checkpoint folder ``latest`` names, else the newest complete one, else None."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if name:
            return os.path.join(root, name)
    steps = complete_steps(root)
    return os.path.join(root, step_dir_name(steps[-1])) if steps else None


def resolve_checkpoint(spec: str, run_dir: Optional[str]) -> str:
    """``latest`` (the run directory's newest), a ``step_N`` folder, a ``checkpoints`` folder or
    a run directory → the checkpoint folder. CheckpointError if there is none."""
    if spec == "latest":
        if run_dir is None:
            raise CheckpointError("--resume latest needs a run directory. Fix: pass --run-dir RUN_DIR, or give the "
                                  "checkpoint folder itself (--resume RUN_DIR/checkpoints/step_N).")
        found = read_latest(checkpoints_root(run_dir))
        if found is None:
            raise CheckpointError(f"--resume latest: no complete checkpoint under {checkpoints_root(run_dir)!r}. "
                                  f"Fix: check --run-dir, or start without --resume.")
        return found
    if not os.path.isdir(spec):
        raise CheckpointError(f"checkpoint {spec!r} does not exist. Fix: give a RUN_DIR/checkpoints/step_N folder, "
                              f"a run directory, or 'latest'.")
    if os.path.isfile(os.path.join(spec, META)) or os.path.isfile(os.path.join(spec, ".metadata")):
        return spec
    for root in (spec, checkpoints_root(spec)):
        if os.path.isdir(root) and (os.path.isfile(os.path.join(root, LATEST)) or complete_steps(root)):
            return read_latest(root)
    raise CheckpointError(f"{spec!r} holds no gridshard checkpoint (no meta.json, no step_N folders). Fix: give a "
                          f"RUN_DIR/checkpoints/step_N folder or the run directory that holds checkpoints/.")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> None:
    """Write, flush and fsync a JSON file."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def describe_files(folder: str, prefix: str = "") -> dict:
    """name → {bytes, sha256} of the files in ``folder`` whose name starts with ``prefix``."""
    return {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
            for name in sorted(os.listdir(folder))
            if name.startswith(prefix) and name != MANIFEST and os.path.isfile(os.path.join(folder, name))}


def write_manifest(folder: str, known: Optional[dict] = None) -> dict:
    """Size and sha256 of every file in ``folder`` (except the manifest), written last.
    ``known``: entries already computed (each rank hashes the chunk files it wrote), the
    rest are hashed here."""
    known = known or {}
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != MANIFEST and os.path.isfile(path):
            files[name] = known.get(name) or {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"format": FORMAT, "files": files}
    write_json(os.path.join(folder, MANIFEST), manifest)
    return manifest


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _where(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))


def _damaged(folder: str, what: str) -> CheckpointError:
    root = os.path.dirname(os.path.normpath(folder))
    others = [step_dir_name(s) for s in complete_steps(root) if step_dir_name(s) != _where(folder)]
    hint = f"resume from another checkpoint ({', '.join(others[-3:])})" if others else "start the run afresh"
    return CheckpointError(f"checkpoint {_where(folder)} at {folder!r} is incomplete or damaged: {what}. Nothing was "
                           f"loaded. Fix: {hint}.")


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise _damaged(folder, f"{MANIFEST} is missing (the save did not finish)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise _damaged(folder, f"{MANIFEST} is not a valid manifest ({e})") from None
    for required in (META, ".metadata"):
        if required not in files:
            raise _damaged(folder, f"{MANIFEST} lists no {required}")
    return manifest


def verify_checkpoint(folder: str, hash_share: tuple = (0, 1)) -> dict:
    """Check ``folder`` against its manifest: every file present with its size; the sha256 of
    the files ``i ≡ rank (mod world)`` for ``hash_share = (rank, world)`` (so ranks split the
    hashing; the default hashes all; world 0 hashes none — a quick check of sizes only).
    Returns the manifest; CheckpointError otherwise."""
    manifest = read_manifest(folder)
    rank, world = hash_share
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise _damaged(folder, f"{name} is missing")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise _damaged(folder, f"{name} has {size} bytes, the manifest says {info['bytes']} (truncated or "
                                   f"overwritten)")
        if world and i % world == rank and _sha256(path) != info["sha256"]:
            raise _damaged(folder, f"{name} does not match its sha256 in {MANIFEST} (the file was modified)")
    return manifest


def read_meta(folder: str) -> dict:
    """``meta.json`` of a checkpoint (after :func:`verify_checkpoint`)."""
    try:
        with open(os.path.join(folder, META)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _damaged(folder, f"{META} cannot be read ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {folder!r} has format {meta.get('format')!r}; this gridshard reads "
                              f"format {FORMAT}. Fix: use the gridshard version that wrote it.")
    return meta


def update_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def publish(partial: str, final: str) -> None:
    """Rename a finished ``step_N.partial`` to ``step_N`` (replacing an older ``step_N`` left by
    a run that was resumed from an earlier step) and update ``latest``."""
    root = os.path.dirname(final)
    if os.path.exists(final):
        old = final + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    fsync_dir(root)


def prune(root: str, keep: int) -> list:
    """Delete all but the newest ``keep`` complete checkpoints (0: keep all); never the one
    ``latest`` names. Returns the removed folders."""
    if keep <= 0:
        return []
    latest = read_latest(root)
    removed = []
    for s in complete_steps(root)[:-keep]:
        path = os.path.join(root, step_dir_name(s))
        if latest is not None and os.path.normpath(path) == os.path.normpath(latest):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_partials(root: str) -> None:
    """Remove the leftovers of saves that never finished (``*.partial``, ``*.replaced``)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.endswith(PARTIAL) or name.endswith(".replaced") or name == LATEST + ".tmp":
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


# ---- DCP's .metadata, unpickled through an allow-list ------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,               # every class of DCP's metadata module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        allowed = _ALLOWED.get(module, set())
        if module in _ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeMetadataReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled through an allow-list of DCP's own
    metadata classes (no arbitrary code runs on load)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise _damaged(str(self.path), f".metadata cannot be read safely ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
