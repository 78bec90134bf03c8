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
the few classes that describe tensors (an allow-list, like ``weights_only``) and which
refuses any entry that is not a tensor. Every reader goes through
:mod:`gridshard.checkpoint.reader`, which adds the checks that need more than one file
(``meta.json`` against the tensors, chunk locations against the manifest).

Paths stay inside the checkpoints folder: ``latest`` must be a plain file holding a
``step_N`` name (no ``..``, no separators, no absolute path); a step folder, or a file in
it, that is a symbolic link is refused; the manifest and DCP's index may name only plain
file names of the folder. Refusals never print what a refused file holds.
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

from ..errors import CheckpointError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def complete_steps(root: str) -> list:
    """Steps with a complete-looking folder (a real ``step_N`` folder, not a symbolic link,
    holding a manifest), sorted."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


_POINTER_MAX_BYTES = 64          # "step_N\n" with any step that fits in an int64 is far shorter


def read_latest(root: str) -> Optional[str]:
    """The checkpoint folder ``latest`` names, else the newest complete one, else None.

    ``latest`` is trusted only as a name: a plain file (not a symbolic link) holding
    ``step_N`` — no separator, no ``..``, no absolute path — so the folder it names is a
    child of ``root``, and that child must not be a symbolic link either. Anything else is a
    CheckpointError that says what is wrong but never prints what the file holds (it might
    be, through a link, any file the user can read)."""
    pointer = os.path.join(root, LATEST)
    fix = (f"Fix: delete {pointer!r} (gridshard then uses the newest complete checkpoint) or write the name of "
           f"a complete checkpoint folder into it (e.g. `echo step_K > {pointer}`), or give the checkpoint folder "
           f"itself (--resume {os.path.join(root, 'step_K')}).")
    if os.path.islink(pointer):
        raise CheckpointError(f"{pointer!r} is a symbolic link; gridshard writes `latest` as a plain file holding "
                              f"a step_N name, and does not follow links out of the checkpoints folder. {fix}")
    if os.path.lexists(pointer):
        if not os.path.isfile(pointer):
            raise CheckpointError(f"{pointer!r} is not a plain file; gridshard writes `latest` as a plain file "
                                  f"holding a step_N name. {fix}")
        with open(pointer, "rb") as f:
            raw = f.read(_POINTER_MAX_BYTES + 1)
        try:
            name = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            name = None
        if name is None or len(raw) > _POINTER_MAX_BYTES or (name and not _STEP_DIR.match(name)):
            raise CheckpointError(f"{pointer!r} does not hold a step_N folder name (its content is not shown); "
                                  f"`latest` may only name a step_N folder inside {root!r} (no '..', no separators, "
                                  f"no absolute path). {fix}")
        if name:
            folder = os.path.join(root, name)
            if os.path.islink(folder):
                raise CheckpointError(f"{pointer!r} names {name}, which is a symbolic link; a checkpoint folder must "
                                      f"be a real folder inside {root!r}. {fix}")
            return folder
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
        if os.path.isdir(root) and (os.path.lexists(os.path.join(root, LATEST)) or complete_steps(root)):
            return read_latest(root)
    raise CheckpointError(f"{spec!r} holds no gridshard checkpoint (no meta.json, no step_N folders). Fix: give a "
                          f"RUN_DIR/checkpoints/step_N folder or the run directory that holds checkpoints/.")


def _sha256(path: str, nofollow: bool = False) -> str:
    h = hashlib.sha256()
    with _open_nofollow(path) if nofollow else open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> None:
    """Write, flush and fsync a JSON file."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def describe_files(folder: str, prefix: str = "", known: Optional[dict] = None) -> dict:
    """name → {bytes, sha256} of the files in ``folder`` (but the manifest) whose name starts
    with ``prefix``; ``known``: entries already computed, the rest are hashed here."""
    known = known or {}
    return {name: known.get(name) or {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
            for name in sorted(os.listdir(folder))
            if name.startswith(prefix) and name != MANIFEST and os.path.isfile(path := os.path.join(folder, name))}


def write_manifest(folder: str, known: Optional[dict] = None) -> dict:
    """Size and sha256 of every file in ``folder`` (except the manifest), written last.
    ``known``: entries already computed (each rank hashes the chunk files it wrote)."""
    manifest = {"format": FORMAT, "files": describe_files(folder, known=known)}
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


class Refused(Exception):
    """What is wrong with a checkpoint folder (``what``) and, when the usual advice does not
    fit, the ``fix``; :func:`refusal` turns it into the one-line CheckpointError. Raised by the
    checks below and by :mod:`gridshard.checkpoint.reader`, so that the (costly) advice is
    composed once, where the error leaves."""

    def __init__(self, what: str, fix: Optional[str] = None):
        super().__init__(what)
        self.what, self.fix = what, fix


def newest_verified(root: str, exclude: Optional[str] = None) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (a checkpoints folder) whose every file
    matches its manifest — sizes *and* sha256 — other than ``exclude``; None when there is none.
    This is what advice after a failure may name: a checkpoint that verifies, never merely the
    newest or the one ``latest`` names. Costs one read of each checkpoint tried (newest first;
    normally the first one verifies)."""
    skip = os.path.realpath(exclude) if exclude else None
    for step in reversed(complete_steps(root)):
        path = os.path.join(root, step_dir_name(step))
        if skip is not None and os.path.realpath(path) == skip:
            continue
        try:
            _verify(path, (0, 1))
        except Refused:
            continue
        return path
    return None


def refusal(folder: str, what: str, fix: Optional[str] = None) -> CheckpointError:
    """The CheckpointError for a refused checkpoint ``folder``: what is wrong, then the fix —
    by default the newest *other* checkpoint next to it that verifies (:func:`newest_verified`),
    named by its path, else a fresh start."""
    if fix is None:
        root = os.path.dirname(os.path.normpath(folder))
        good = newest_verified(root, exclude=folder) if os.path.isdir(root) else None
        fix = (f"use the newest checkpoint next to it that verifies, {good} (to continue training: --resume {good}), "
               f"or start the run afresh" if good else
               f"start the run afresh (no other checkpoint in {root!r} verifies)")
    return CheckpointError(f"checkpoint {_where(folder)} at {folder!r} is incomplete or damaged: {what}. Nothing was "
                           f"loaded. Fix: {fix}.")


def _plain_name(name) -> bool:
    """A file name of the folder itself: no separator, not ``.``/``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name)


def _open_nofollow(path: str):
    """Open ``path`` for reading, refusing a symbolic link even if one replaced the file
    since it was checked."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def check_folder(folder: str) -> None:
    """``folder`` is a real folder (not a symbolic link) and no entry in it is a symbolic link
    or anything but a plain file: so every read of a checkpoint stays inside its folder.
    Raises :class:`Refused`."""
    if not os.path.lexists(folder):
        raise Refused("the folder does not exist", fix="give an existing RUN_DIR/checkpoints/step_N folder or a run "
                                                       "directory")
    if os.path.islink(folder):
        raise Refused("the folder is a symbolic link; a checkpoint is read only from a real folder, so that nothing "
                      "outside it is read through it", fix="copy the checkpoint folder itself into place")
    if not os.path.isdir(folder):
        raise Refused("it is not a folder", fix="give a RUN_DIR/checkpoints/step_N folder or a run directory")
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path):
            raise Refused(f"{name[:80]!r} in it is a symbolic link; every file of a checkpoint must be a plain file "
                          f"inside its folder", fix="copy the real file into the folder (or use another checkpoint)")
        if not os.path.isfile(path):
            raise Refused(f"{name[:80]!r} in it is not a plain file (gridshard writes only plain files)")


def _read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise Refused(f"{MANIFEST} is missing (the save did not finish)")
    try:
        with _open_nofollow(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not an object")
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise Refused(f"{MANIFEST} is not a valid manifest ({type(e).__name__}: {str(e)[:120]})") from None
    for name, info in files.items():
        if not _plain_name(name) or name == MANIFEST:
            raise Refused(f"{MANIFEST} lists {name[:80]!r}, which is not a file name of the folder (a manifest "
                          f"names plain files of its own folder only)")
        if not (isinstance(info, dict) and type(info.get("bytes")) is int and info["bytes"] >= 0
                and isinstance(info.get("sha256"), str)):
            raise Refused(f"{MANIFEST} is not a valid manifest (the entry of {name[:80]!r} is not "
                          f"{{bytes, sha256}})")
    for required in (META, ".metadata"):
        if required not in files:
            raise Refused(f"{MANIFEST} lists no {required}")
    return manifest


def _verify(folder: str, hash_share: tuple) -> dict:
    """:func:`verify_checkpoint` raising :class:`Refused`."""
    check_folder(folder)
    manifest = _read_manifest(folder)
    rank, world = hash_share
    mine = []
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise Refused(f"{name} is missing")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise Refused(f"{name} has {size} bytes, the manifest says {info['bytes']} (truncated or overwritten)")
        if world and i % world == rank:
            mine.append(name)
    if mine:                         # hashlib releases the GIL on large buffers: threads read and hash in parallel
        from concurrent.futures import ThreadPoolExecutor

        try:
            with ThreadPoolExecutor(max_workers=min(8, len(mine), os.cpu_count() or 1)) as pool:
                digests = list(pool.map(lambda n: _sha256(os.path.join(folder, n), nofollow=True), mine))
        except OSError as e:
            raise Refused(f"a file cannot be read ({e.strerror})") from None
        for name, digest in zip(mine, digests):
            if digest != manifest["files"][name]["sha256"]:
                raise Refused(f"{name} does not match its sha256 in {MANIFEST} (the file was modified)")
    return manifest


def _refused(check, folder: str, *args):
    """``check(folder, *args)`` with a :class:`Refused` raised as :func:`refusal`'s CheckpointError."""
    try:
        return check(folder, *args)
    except Refused as r:
        raise refusal(folder, r.what, r.fix) from None


def read_manifest(folder: str) -> dict:
    return _refused(_read_manifest, folder)


def verify_checkpoint(folder: str, hash_share: tuple = (0, 1)) -> dict:
    """Check ``folder`` against its manifest: a real folder of plain files (no symbolic
    links, :func:`check_folder`), every listed file present with its size; the sha256 of the
    files ``i ≡ rank (mod world)`` for ``hash_share = (rank, world)`` (so ranks split the
    hashing; the default hashes all; world 0 hashes none — a quick check of sizes only).
    Returns the manifest; CheckpointError otherwise, naming the newest other checkpoint that
    verifies as the fix.

    The manifest guards against *accidental* damage (a truncated or flipped file, a save that
    never finished). It is not an authenticity check: whoever can write the folder can
    rewrite the manifest too. What keeps a hostile checkpoint from running code is that
    nothing in it is unpickled beyond the allow-list and only tensors are loaded
    (:mod:`gridshard.checkpoint.reader`)."""
    return _refused(_verify, folder, hash_share)


def _read_meta(folder: str) -> dict:
    """``meta.json`` parsed and its fields that readers use type-checked; raises :class:`Refused`."""
    try:
        with _open_nofollow(os.path.join(folder, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise Refused(f"{META} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(meta, dict):
        raise Refused(f"{META} is not a JSON object")
    if meta.get("format") != FORMAT:
        fmt = meta.get("format")
        raise Refused(f"it has format {fmt if type(fmt) is int else '(not a number)'}; this gridshard reads format "
                      f"{FORMAT}", fix="use the gridshard version that wrote it")
    for key in ("step", "samples", "world_size"):
        if key in meta and not (type(meta[key]) is int and meta[key] >= 0):
            raise Refused(f"{META}'s {key!r} is not a non-negative integer")
    if "step" not in meta:
        raise Refused(f"{META} has no 'step'")
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise Refused(f"{META} has no 'config' object with a 'model' section")
    for section in ("train", "data", "parallel"):
        if not isinstance(config.get(section, {}), dict):
            raise Refused(f"{META}'s config.{section} is not an object")
    if not isinstance(meta.get("loss_scaler") or {}, dict):
        raise Refused(f"{META}'s 'loss_scaler' is not an object")
    m = _STEP_DIR.match(_where(folder))
    if m and int(m.group(1)) != meta["step"]:
        raise Refused(f"the folder is {_where(folder)} but its {META} says step {meta['step']}")
    return meta


def read_meta(folder: str) -> dict:
    """``meta.json`` of a checkpoint (JSON; the fields readers use type-checked): CheckpointError
    otherwise. The complete check of a checkpoint is :func:`gridshard.checkpoint.reader.open_checkpoint`."""
    return _refused(_read_meta, folder)


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


def _weights_finite(folder: str) -> bool:
    """Whether ``meta.json`` does not record non-finite weights (``weights_finite``, written by
    the save's check since it exists; an older checkpoint without the field counts as finite,
    an unreadable ``meta.json`` as not)."""
    try:
        with open(os.path.join(folder, META)) as f:
            return json.load(f).get("weights_finite", True) is not False
    except (OSError, ValueError, AttributeError):
        return False


def prune(root: str, keep: int) -> list:
    """Delete all but the newest ``keep`` complete checkpoints (0: keep all); never the one
    ``latest`` names, never the newest one whose weights are finite (``weights_finite``: the
    save refuses to publish non-finite weights, so this only matters for folders written
    otherwise — it keeps a diverged run from pruning its last good checkpoint). Returns the
    removed folders."""
    if keep <= 0:
        return []
    latest = read_latest(root)
    steps = complete_steps(root)
    finite = next((s for s in reversed(steps) if _weights_finite(os.path.join(root, step_dir_name(s)))), None)
    removed = []
    for s in steps[:-keep]:
        path = os.path.join(root, step_dir_name(s))
        if s == finite or (latest is not None and os.path.normpath(path) == os.path.normpath(latest)):
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
# Exactly the classes DCP pickles to describe tensor chunks (a ``Metadata`` of
# ``TensorStorageMetadata`` entries, traced from a real gridshard checkpoint), torch dtypes
# (added in find_class) and a few inert containers. Not "every class of DCP's metadata module":
# that admits ``BytesStorageMetadata``, an entry DCP's default planner loads with
# ``torch.load(weights_only=False)`` — arbitrary code.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},       # a torch.layout by its name, from a fixed table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},    # StorageMeta.checkpoint_id (the folder it was saved in)
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{str(module)[:80]}.{str(name)[:80]} is not allowed in a checkpoint's .metadata")


def read_dcp_metadata(folder: str):
    """DCP's ``.metadata`` of ``folder`` through the allow-list, every entry a tensor;
    raises :class:`Refused`."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = os.path.join(str(folder), ".metadata")
    try:
        with _open_nofollow(path) as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise Refused(".metadata is missing") from None
    except Exception as e:      # noqa: BLE001 - anything an allowed class raises on hostile arguments
        raise Refused(f".metadata cannot be read safely ({type(e).__name__}: {str(e)[:160]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise Refused(".metadata does not hold DCP's index of tensors")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise Refused(f".metadata entry {str(fqn)[:80]!r} is a {type(md).__name__}, not a tensor: gridshard "
                          f"checkpoints hold tensors only (DCP would unpickle a non-tensor entry with "
                          f"torch.load(weights_only=False), which can run code)")
    return metadata


class SafeMetadataReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled through the allow-list above and holds
    tensors only (no arbitrary code runs on load). Readers use it through
    :mod:`gridshard.checkpoint.reader`, which checks the rest before loading."""

    def read_metadata(self, *args, **kwargs):
        return self._with_load_id(_refused(read_dcp_metadata, str(self.path)))

    def _with_load_id(self, metadata):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
