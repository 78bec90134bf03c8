"""The run directory of ``gridshard train``: which process owns it (the launcher, or rank 0
under torchrun), the checks that it is free, writable and holds no earlier run (looking only:
a refusal creates nothing), then its claim — created, locked for the life of the job
(gridshard/run_lock.py), emptied with ``--overwrite`` — and the prepared data's tokenizer
copied into it."""
from __future__ import annotations

import os
import shutil
import time

import click

from ..errors import ConfigError


def _owns_run_dir(launched: bool) -> bool:
    """The process that speaks for the job and takes the run-directory lock (gridshard/run_lock.py):
    the local launcher, or rank 0 under torchrun (one per job, also across nodes)."""
    return not launched or os.environ.get("RANK") == "0"


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


RUN_OUTPUTS = ("metrics.jsonl", "ranks.jsonl", "launch.json", "checkpoints", "logs", "tb", "profile", "flight_recorder")


def _check_not_live(run_dir: str, overwrite: bool, launched: bool) -> None:
    """Refuse a run directory whose lock a live run holds (:mod:`gridshard.run_lock`), naming
    its PID and host; ``--overwrite`` included. Looked at by the process that would take the lock
    (the others of a torchrun job would see their own rank 0's), except in an elastic restart,
    whose dead predecessor may still hold it (:func:`_claim_run_dir` waits for that one)."""
    from ..run_lock import in_use_message, live_holder

    if _owns_run_dir(launched) and not _restarted():
        holder = live_holder(run_dir)
        if holder is not None:
            raise ConfigError(in_use_message(run_dir, holder, overwrite))


def _check_run_dir(run_dir: str, cfg, overwrite: bool, launched: bool) -> None:
    """The run directory is not in use by a live run (its lock, :mod:`gridshard.run_lock`), can
    be created and written, and holds no earlier run unless this one continues it
    (``--resume``/``train.resume``, an elastic restart) or ``--overwrite`` removes it. Looks
    only: a refusal leaves the file system as it was; :func:`_claim_run_dir` acts once every
    check has passed."""
    from ..fsutil import cannot_create

    if overwrite and cfg.train.resume != "never":
        raise ConfigError("--overwrite and --resume/train.resume were both given: one starts over, the other "
                          "continues. Fix: pass one of them.")
    _check_not_live(run_dir, overwrite, launched)
    _check_no_earlier_run(run_dir, cfg, overwrite)
    why = cannot_create(run_dir)
    if why is not None:
        raise _not_writable(run_dir, why)


def _continuing(cfg) -> bool:
    return cfg.train.resume != "never" or _restarted()


def _check_no_earlier_run(run_dir: str, cfg, overwrite: bool) -> None:
    previous = [x for x in RUN_OUTPUTS if os.path.exists(os.path.join(run_dir, x))]
    if previous and not _continuing(cfg) and not overwrite:
        raise ConfigError(f"run directory {run_dir!r} already holds a run ({', '.join(previous)}). Fix: "
                          f"--resume latest to continue it, --overwrite to start over, or another --run-dir.")


def _not_writable(run_dir: str, why: str) -> ConfigError:
    return ConfigError(f"run directory {run_dir!r} is not writable ({why}). Fix: choose a --run-dir you can write.")


# how long an elastic restart's rank 0 waits for the lock its dead predecessor held (the agent
# stops the old workers before it starts new ones: normally no wait at all)
RESTART_LOCK_WAIT_S = 30.0


def _claim_run_dir(run_dir: str, cfg, overwrite: bool, launched: bool):
    """After every check passed: create the run directory, take its lock (the owner,
    :func:`_owns_run_dir`; held until this command ends — released when its click context
    closes, or by the kernel when the process dies) and, with ``--overwrite``, remove the earlier
    run's outputs under the lock. The lock is taken before anything in the directory is created
    or removed; if it is refused (a run that started since the check), the folders created for it
    are removed again. Returns the lock (None for ranks other than the owner)."""
    from ..fsutil import make_dirs, remove_made
    from ..run_lock import acquire

    try:
        created = make_dirs(run_dir)
    except OSError as e:
        raise _not_writable(run_dir, e.strerror) from None
    if not _owns_run_dir(launched):
        return None
    try:
        lock = acquire(run_dir, wait_s=RESTART_LOCK_WAIT_S if _restarted() else 0.5, overwrite=overwrite)
    except ConfigError:
        remove_made(created)
        raise
    except OSError as e:
        remove_made(created)
        raise _not_writable(run_dir, e.strerror) from None
    try:
        _check_no_earlier_run(run_dir, cfg, overwrite)      # a run that began and ended since the check
    except ConfigError:
        lock.release()
        raise
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(lock.release)
    if overwrite and not _continuing(cfg):
        for name in RUN_OUTPUTS:
            path = os.path.join(run_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
    return lock


def _copy_tokenizer(cfg, run_dir: str) -> None:
    """``RUN_DIR/tokenizer/``: the prepared folder's meta.json and tokenizer.json, so that
    ``gridshard generate RUN_DIR`` decodes even after the data folder moves."""
    if cfg.data.kind != "prepared":
        return
    dest = os.path.join(run_dir, "tokenizer")
    os.makedirs(dest, exist_ok=True)
    for name in ("meta.json", "tokenizer.json"):
        if os.path.isfile(os.path.join(cfg.data.path, name)):
            shutil.copyfile(os.path.join(cfg.data.path, name), os.path.join(dest, name))
