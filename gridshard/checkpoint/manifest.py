"""``manifest.json``, written last into a checkpoint folder: the size and sha256 of every
other file (:func:`write_manifest`), and the file helpers that write and hash (JSON written with
fsync, hashing that may refuse a symbolic link). Reading it back and checking the folder against
it is :mod:`gridshard.checkpoint.verify`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from .folders import FORMAT, MANIFEST, write_synced


def _open_nofollow(path: str):
    """Open ``path`` for reading, refusing a symbolic link even if one replaced the file
    since it was checked."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def _sha256(path: str, nofollow: bool = False) -> str:
    h = hashlib.sha256()
    with _open_nofollow(path) if nofollow else open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> None:
    """Write, flush and fsync a JSON file."""
    write_synced(path, json.dumps(obj, indent=1, sort_keys=True))


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
