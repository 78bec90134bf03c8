"""What a failed or stopped ``gridshard train`` says: the rank logs a worker writes
(``RUN_DIR/logs/rank_N.log``), the one-line failure naming the rank that stalled, raised or
died, the "stopped at step N" lines of an interrupt, and the last complete checkpoint that
verifies, with the command that continues from it."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .common import EXIT_WORKER_ERROR


def rank_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank_{rank}.log")


def write_rank_log(run_dir: str, rank: int, error: BaseException) -> None:
    """``RUN_DIR/logs/rank_N.log``: first line ``<unix time> <Type>: <message>`` (the cause,
    one line), then the full traceback. Never raises: when the log cannot be written (a full
    or read-only disk — often the very error being logged) the cause line goes to stderr
    instead, and :func:`failure_message` says where to look."""
    cause = " ".join(f"{type(error).__name__}: {error}".split())
    try:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        with open(rank_log_path(run_dir, rank), "w") as f:
            f.write(f"{time.time():.6f} {cause}\n")
            traceback.print_exception(type(error), error, error.__traceback__, file=f)
    except Exception as e:  # noqa: BLE001 - the logger of last resort must not fail
        try:
            sys.stderr.write(f"gridshard: rank {rank}: {cause} (its log {rank_log_path(run_dir, rank)} could "
                             f"not be written: {getattr(e, 'strerror', None) or e})\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass


def _last_logged_step(run_dir: str):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return json.loads(f.read().splitlines()[-1])["step"]
    except (OSError, IndexError, ValueError, KeyError):
        return None


def stopped_at_message(step: int, checkpoint, run_dir: str) -> str:
    """What a run stopped by Ctrl-C says: the step, the checkpoint written at it, how to go on."""
    where = (f"checkpoint {checkpoint} (resume with --resume latest: gridshard train ... --run-dir {run_dir} "
             f"--resume latest)" if checkpoint else "no checkpoint (no run directory)")
    return f"stopped at step {step}; {where}; metrics in {os.path.join(run_dir, 'metrics.jsonl')}"


def last_good_checkpoint(run_dir: str, command: str = "gridshard train ...") -> str:
    """``last complete checkpoint: X (continue with: …)`` for the newest checkpoint under
    ``RUN_DIR/checkpoints`` that *verifies* (every file's size and sha256 against its manifest,
    :func:`gridshard.checkpoint.files.newest_verified`) — never merely the one ``latest`` names,
    which may be the damaged one. ``--resume latest`` is advised only when ``latest`` names that
    very checkpoint; otherwise its folder is given. Reads the checkpoint once to hash it."""
    from ..checkpoint.files import checkpoints_root, complete_steps, latest_or_none, newest_verified

    root = checkpoints_root(run_dir)
    good = newest_verified(root)
    if good is None:
        return (f"no checkpoint under {root} verifies (start afresh)" if complete_steps(root)
                else "no complete checkpoint was written")
    latest = latest_or_none(root)                      # None for a `latest` gridshard did not write
    if latest is not None and os.path.realpath(latest) == os.path.realpath(good):
        return f"last complete checkpoint: {good} (continue with: {command} --run-dir {run_dir} --resume latest)"
    def step_of(path):                               # both are step_N names (read_latest checks it)
        return int(os.path.basename(path).rpartition("_")[2])

    newer = latest is not None and step_of(latest) > step_of(good)   # newest first: so it did not verify
    note = f"; {os.path.basename(latest)}, which `latest` names, does not verify" if newer else ""
    return f"last complete checkpoint: {good} (continue with: {command} --run-dir {run_dir} --resume {good}{note})"


def stopped_message(run_dir: str, aborted: bool = False) -> str:
    """What a run ended by signals says when the workers did not stop on their own (a second
    Ctrl-C, a signal before training began, torchrun's SIGTERM): the last logged step, the
    metrics and the last complete checkpoint that verifies (:func:`last_good_checkpoint`)."""
    step = _last_logged_step(run_dir)
    return (f"stopped at step {step if step is not None else 0} (the last logged step"
            f"{'; the workers were killed at the second interrupt' if aborted else ''}; metrics in "
            f"{os.path.join(run_dir, 'metrics.jsonl')}); " + last_good_checkpoint(run_dir, "gridshard train ..."))


def _worker_cause(run_dir: str, rank: int):
    """(time, cause line) from ``RUN_DIR/logs/rank_N.log``, or None."""
    try:
        with open(rank_log_path(run_dir, rank)) as f:
            stamp, _, cause = f.readline().rstrip("\n").partition(" ")
        return float(stamp), cause
    except (OSError, ValueError):
        return None


def failure_message(error, run_dir: str, stalled=(), timeout_s=None) -> str:
    """The failure in one line — the ranks that stalled (``stalled``: [(rank, silent seconds)]
    from their heartbeats, :func:`gridshard.engine.control.stalled_ranks`), else the rank that
    raised first and its cause (traceback in ``RUN_DIR/logs/rank_N.log``), or the ranks that
    died (signal or exit code) — then the last complete checkpoint that verifies
    (:func:`last_good_checkpoint`)."""
    raised = {r: _worker_cause(run_dir, r) for r, f in error.failures.items() if f.exitcode == EXIT_WORKER_ERROR}
    raised = {r: c for r, c in raised.items() if c is not None}
    first = min(raised, key=lambda r: (raised[r][0], r)) if raised else None      # the rank that raised first
    if stalled:
        names = ", ".join(f"rank {r} (silent for its last {s:.0f} s)" for r, s in stalled)
        them = "it" if len(stalled) == 1 else "them"
        line = (f"training failed: {names} stopped answering (stopped, hung or swapped out; no heartbeat in "
                f"{os.path.join(run_dir, 'logs')}): the other ranks waited for {them} in a collective for "
                f"train.collective_timeout_s={timeout_s:g} s, then gave up; "
                f"{'it was' if len(stalled) == 1 else 'they were'} killed")
        if raised:
            line += f" (rank {first}: {raised[first][1][:200]}; traceback: {rank_log_path(run_dir, first)})"
        lines = [line]
    elif raised:
        lines = [f"training failed: rank {first}: {raised[first][1]} (traceback: {rank_log_path(run_dir, first)})"]
    else:
        lines = ["training failed:"]
        for rank, f in sorted(error.failures.items()):      # none raised with a log: each died or failed
            how = f"died ({f.signal_name()})" if f.exitcode < 0 else f"failed (exit code {f.exitcode})"
            if f.exitcode == EXIT_WORKER_ERROR:        # raised, but its log could not be written
                lines.append(f"  rank {rank} raised an error; its log {rank_log_path(run_dir, rank)} could not be "
                             f"written (full or read-only disk?): the cause is the 'gridshard: rank {rank}:' line "
                             f"above")
                continue
            lines.append(f"  rank {rank} {how}" + (f": {f.message}" if f.exitcode >= 0 and f.message else ""))
    lines.append(last_good_checkpoint(run_dir))
    return "\n".join(lines)
