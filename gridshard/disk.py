"""A run directory that cannot be written: the cause in one line.

A save that fails on a full disk rarely says so itself: torch's zip writer reports a short
write as ``RuntimeError: ... unexpected pos 704 vs 598`` and DCP wraps every rank's error in a
``CheckpointException`` whose text is each rank's traceback (a read-only file system comes out
as a dump of an ``OSError``). :func:`write_failure` finds the cause

1. from an ``errno`` anywhere in the error (its causes, its context, DCP's per-rank failures):
   ENOSPC / EDQUOT full, EROFS read-only, EACCES / EPERM not permitted;
2. else from the file system itself (``os.statvfs`` of the nearest existing folder): its
   read-only flag, and the free bytes against what the write needs (a short write on a disk
   that cannot hold the checkpoint is a full disk, whatever the error says);

and says it in one line: the run directory, free and needed bytes, what was lost, the last
complete checkpoint and a fix. Anything else is not a disk error (None): the caller reports it
as it is, in one line (:func:`one_line`).
"""
from __future__ import annotations

import errno
import os
from typing import Iterator, Optional

FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS,)
DENIED = (errno.EACCES, errno.EPERM)
DISK_ERRNOS = FULL + READ_ONLY + DENIED


def format_bytes(n: Optional[float]) -> str:
    """Decimal units, one decimal: ``3.0 MB``."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, its ``__cause__``/``__context__`` chain and DCP's per-rank failures
    (``CheckpointException.failures``: rank → (exception, traceback))."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for item in failures.values():
                todo.append(item[0] if isinstance(item, tuple) else item)


def disk_errno(error: BaseException) -> Optional[int]:
    """The first disk-related ``errno`` found in ``error`` (module docstring), else None."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e.errno
    return None


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line; for DCP's ``CheckpointException`` the first rank's error
    (its text is every rank's traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        item = failures[rank]
        inner = item[0] if isinstance(item, tuple) else item
        if isinstance(inner, BaseException):
            return f"rank {rank}: {one_line(inner)}"
    return " ".join(f"{type(error).__name__}: {error}".split())


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _statvfs(path: str):
    """``os.statvfs`` of the nearest existing folder of ``path``, None if it fails."""
    try:
        return os.statvfs(_existing(path))
    except OSError:
        return None


def classify(path: str, error: Optional[BaseException], need: Optional[int] = None) -> Optional[int]:
    """FULL/READ_ONLY/DENIED's errno for a write under ``path`` that failed with ``error``, from
    the error or, failing that, from the file system (module docstring); None: not a disk error."""
    if error is not None and (code := disk_errno(error)) is not None:
        return code
    st = _statvfs(path)
    if st is None:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if need is not None and st.f_bavail * st.f_frsize < need:
        return errno.ENOSPC
    if not os.access(_existing(path), os.W_OK):
        return errno.EACCES
    return None


def write_failure(run_dir: str, path: str, error: Optional[BaseException], lost: str, need: Optional[int] = None,
                  need_what: str = "a checkpoint", last: Optional[str] = None) -> Optional[str]:
    """One line for a failed write under ``path`` (in ``run_dir``), or None when it is not a
    disk error. ``lost``: what was not written (and what was cleaned up); ``need``: bytes the
    write needs (``need_what`` names them); ``last``: the last complete checkpoint."""
    code = classify(path, error, need)
    if code is None:
        return None
    tail = f"last complete checkpoint: {last}" if last else "no complete checkpoint was written"
    if code in FULL:
        needs = f", {need_what} needs ~{format_bytes(need)}" if need else ""
        st = _statvfs(path)                          # what an unprivileged writer may still use
        free = format_bytes(st.f_bavail * st.f_frsize if st is not None else None)
        return (f"run dir {run_dir} is full: {free} free{needs}; {lost}; {tail}. Fix: free "
                f"space there (or lower train.keep_checkpoints, or copy the run directory to a larger disk), then "
                f"continue with --resume latest.")
    if code in READ_ONLY:
        return (f"run dir {run_dir} is on a read-only file system; {lost}; {tail}. Fix: make it writable again (or "
                f"copy the run directory to a writable disk), then continue with --resume latest.")
    return (f"run dir {run_dir} is not writable (permission denied{_where(error)}); {lost}; {tail}. Fix: give this "
            f"user write access there (or copy the run directory elsewhere), then continue with --resume latest.")


def _where(error: Optional[BaseException]) -> str:
    for e in _causes(error) if error is not None else ():
        if isinstance(e, OSError) and e.errno in DENIED and e.filename:
            return f": {e.filename}"
    return ""
