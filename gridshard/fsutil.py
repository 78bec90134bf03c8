"""Folders a command creates, and only once it has accepted its inputs.

A refused command leaves the file system as it was. So a command first asks
:func:`cannot_create` (which creates nothing) whether its output folder could be made and
written, refuses if not, and creates it with :func:`make_dirs` only after every other check has
passed; if it still fails afterwards (a race, a full disk), :func:`remove_made` takes away the
folders it made — with ``os.rmdir``, which removes only empty folders, so nothing anyone else put
there in the meantime is ever deleted.
"""
from __future__ import annotations

import os
from typing import List, Optional


def cannot_create(path: str) -> Optional[str]:
    """Why folder ``path`` could not be created (or, if it exists, written) — ``None`` if it can.
    Looks only: the nearest existing ancestor must be a folder this process may write and enter
    (``os.access``, which also sees a read-only file system). Advisory, as any such check: the
    creation itself may still fail, and its caller handles that too."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except (OSError, AttributeError):
            read_only = False
        return "read-only file system" if read_only else f"permission denied on {probe}"
    return None


def make_dirs(path: str) -> List[str]:
    """``os.makedirs(path, exist_ok=True)``, returning the folders it created, outermost first."""
    path = os.path.abspath(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(path, exist_ok=True)
    return missing[::-1]


def remove_made(created: List[str]) -> None:
    """Undo :func:`make_dirs`: remove the folders it created, innermost first, if still empty."""
    for folder in reversed(created):
        try:
            os.rmdir(folder)
        except OSError:
            return                               # not empty (someone else's now) or gone: stop there
