"""Who owns a run directory: ``RUN_DIR/.gridshard.lock``.

One training job at a time may write a run directory — metrics.jsonl, checkpoints and
``latest``, logs. Two at once interleave their metrics and race on ``latest``; an
``--overwrite`` of a live run deletes the files of a job that is still writing them. So the job
holds an exclusive ``flock`` on ``RUN_DIR/.gridshard.lock`` for its whole life, and ``gridshard
train`` refuses (exit 2, before launch, naming the holder) a run directory whose lock is held.

Who holds it: the process that owns the job's life.

* ``gridshard train`` outside a launcher: the launcher process — it takes the lock before it
  creates or removes anything in the run directory and keeps it while its workers run (they take
  none; they die with it, :mod:`gridshard.parent_death`). Elastic restarts (``--max-restarts``)
  happen inside it, under the same lock.
* Under ``torchrun``: the process with ``RANK`` 0 — one holder per job, also when the run directory
  is on a file system shared by several nodes (a lock per node would make the nodes refuse each
  other). After an elastic restart the new rank 0 takes the lock its dead predecessor held; it
  waits a while for it (``restart_wait_s`` in :func:`acquire`) in case that one is still exiting.

Stale locks: the kernel drops a ``flock`` when its holder dies, however it dies (SIGKILL, OOM
kill). A lock file left by a dead job is therefore simply re-locked; no PID guessing is needed.
The file's content — JSON ``{"pid", "host", "started"}`` — only names the holder in a refusal.

Clean release: the holder removes the file while still holding the lock, then closes it. A
process that opened the old file meanwhile finds, once it has the lock, that its descriptor no
longer names the path (another inode, or none) and starts over on a new file; so two holders
never coexist, and a finished run leaves no lock file behind.

Probing (:func:`live_holder`) creates nothing: a shared, non-blocking lock on a read-only
descriptor of the file if it exists, released at once; it fails only while a holder lives. A
probe holds its shared lock for microseconds; :func:`acquire` retries for ``wait_s`` so that a
probe never makes it refuse.

File systems without ``flock`` (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``, ``EINVAL``: some network and
parallel file systems): the file is created exclusively (``O_EXCL``) and the PID decides — a
live PID on this host holds the directory; a PID on another host cannot be checked from here
and also holds it (the message names the file to remove if that run has ended); a dead PID on
this host is taken over.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from typing import Optional

from .errors import ConfigError
from .parent_death import pid_alive

try:
    import fcntl
except ImportError:                                  # not POSIX: the PID fallback only
    fcntl = None

LOCK_FILE = ".gridshard.lock"
NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def lock_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOCK_FILE)


def read_holder(path: str, tries: int = 5) -> dict:
    """The holder named in lock file ``path`` ({} if unreadable). A holder writes its name just
    after locking: an empty file is read again a few times."""
    for i in range(tries):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                text = f.read()
            if text.strip():
                holder = json.loads(text)
                return holder if isinstance(holder, dict) else {}
        if i + 1 < tries:
            time.sleep(0.02)
    return {}


def _holder_lives(holder: dict) -> bool:
    """Without flock: whether the PID named in the file still runs (another host: assumed yes)."""
    return bool(holder.get("pid")) and (holder.get("host") != socket.gethostname() or pid_alive(int(holder["pid"])))


def describe(holder: dict) -> str:
    started = holder.get("started")
    when = ""
    if isinstance(started, (int, float)) and started > 0:
        when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
    return f"PID {holder.get('pid', 'unknown')} on {holder.get('host', 'an unknown host')}{when}"


def in_use_message(run_dir: str, holder: dict, overwrite: bool = False) -> str:
    pid = holder.get("pid")
    stop = f"stop it (Ctrl-C in its terminal, or kill {pid})" if pid else "stop it"
    return (f"run directory {run_dir!r} is in use by a live run ({describe(holder)}; it holds "
            f"{lock_path(run_dir)}): two runs in one directory mix their metrics and checkpoints"
            + ("; --overwrite never removes the files of a live run" if overwrite else "")
            + f". Fix: wait for that run to end or {stop}, then try again; or choose another --run-dir.")


def live_holder(run_dir: str) -> Optional[dict]:
    """The holder ({pid, host, started}; possibly {} if unreadable) of a live lock on
    ``run_dir``, or None if no live job holds it. Creates nothing (module docstring)."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None                                  # no lock file (or none this process can open)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
            except BlockingIOError:
                return read_holder(path)
            except OSError as e:
                if e.errno not in NO_FLOCK:
                    raise
        holder = read_holder(path)                   # no flock here: the PID decides
        return holder if _holder_lives(holder) else None
    finally:
        os.close(fd)


class RunLock:
    """A held run-directory lock; :meth:`release` (or leaving its ``with``) gives it up and
    removes the file. The descriptor is close-on-exec: workers and other children do not inherit
    it, so the lock dies with this process alone."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._file = os.fdopen(fd, "r+")             # closed (lock dropped) if ever garbage-collected

    def release(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            if _names(self._file.fileno(), self.path):
                os.remove(self.path)                 # while still locked: see the module docstring
        self._file.close()
        self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _names(fd: int, path: str) -> bool:
    """Whether ``path`` still names the open file ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_holder(fd: int) -> None:
    data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data + b"\n")


def acquire(run_dir: str, wait_s: float = 0.5, overwrite: bool = False) -> RunLock:
    """Take the lock on existing folder ``run_dir``; ConfigError naming the holder if a live
    job holds it for ``wait_s`` seconds. ``overwrite`` only adds to the refusal that
    ``--overwrite`` never removes a live run. OSError if the file cannot be created."""
    path = lock_path(run_dir)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    deadline = time.monotonic() + wait_s
    while fcntl is not None:                         # else (not POSIX) the PID fallback below
        fd = os.open(path, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise ConfigError(in_use_message(run_dir, read_holder(path), overwrite)) from None
        except OSError as e:
            os.close(fd)
            if e.errno in NO_FLOCK:
                return _acquire_by_pid(run_dir, overwrite)
            raise
        if not _names(fd, path):                      # released (file removed) while we waited for it
            os.close(fd)
            continue
        _write_holder(fd)
        return RunLock(path, fd)
    return _acquire_by_pid(run_dir, overwrite)


def _acquire_by_pid(run_dir: str, overwrite: bool) -> RunLock:
    """Where flock is unavailable: an exclusively created file naming a live PID (docstring)."""
    path = lock_path(run_dir)
    holder = read_holder(path, tries=1) if os.path.lexists(path) else None
    if holder is not None:
        if _holder_lives(holder):
            raise ConfigError(in_use_message(run_dir, holder, overwrite)
                              + f" (No file locking here: if that run has ended, remove {path}.)")
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)                          # a dead job's file
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:                          # another job created it just now
        raise ConfigError(in_use_message(run_dir, read_holder(path), overwrite)) from None
    _write_holder(fd)
    return RunLock(path, fd)
