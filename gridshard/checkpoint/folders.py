"""The run's checkpoints folder: names, the ``latest`` pointer, publishing and pruning.

::

    RUN_DIR/checkpoints/
        step_20/                 complete checkpoints only
        step_30/
        step_40.partial/         a save in progress (or killed): never read
        latest                   "step_30": the newest complete checkpoint, replaced atomically

A finished ``step_N.partial/`` is renamed to ``step_N`` (:func:`publish`) and only then is
``latest`` replaced (:func:`update_latest`: write ``latest.tmp``, ``os.replace``), so ``latest``
never names an incomplete folder. ``latest`` must be a plain file holding a ``step_N`` name (no
``..``, no separators, no absolute path) naming a real folder, not a symbolic link
(:func:`read_latest`). What is inside a step folder: :mod:`gridshard.checkpoint.files`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

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
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(name[len("step_"):]) for name in names if _STEP_DIR.match(name)
                  and not os.path.islink(os.path.join(root, name))
                  and os.path.isfile(os.path.join(root, name, MANIFEST)))


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
        name = raw.decode("ascii", errors="replace").strip()   # a non-ASCII byte → U+FFFD: no step_N match
        if len(raw) > _POINTER_MAX_BYTES or (name and not _STEP_DIR.match(name)):
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


def latest_or_none(root: str) -> Optional[str]:
    """:func:`read_latest` for a message: None also where it would refuse (a message must not fail)."""
    try:
        return read_latest(root)
    except Exception:                                   # noqa: BLE001
        return None


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


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, text: str) -> None:
    """Write, flush and fsync a text file."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def update_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    write_synced(tmp, name + "\n")
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def publish(partial: str, final: str) -> None:
    """Rename a finished ``step_N.partial`` to ``step_N`` (replacing an older ``step_N`` left by
    a run that was resumed from an earlier step)."""
    old = final + ".replaced"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(os.path.dirname(final))


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
