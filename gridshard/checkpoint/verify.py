"""Checking a checkpoint folder before anything in it is loaded: a real folder of plain files
(:func:`check_folder`), the manifest's every file present with its size and sha256
(:func:`verify_checkpoint`), ``meta.json`` parsed and type-checked (:func:`read_meta`).

A check raises :class:`Refused` (what is wrong); :func:`refusal` turns it into the one-line
CheckpointError whose fix names the newest other checkpoint that verifies
(:func:`newest_verified`). The checks that need more than one file are
:mod:`gridshard.checkpoint.reader`'s.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import CheckpointError
from .folders import _STEP_DIR, FORMAT, MANIFEST, META, complete_steps, step_dir_name
from .manifest import _open_nofollow, _sha256


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
