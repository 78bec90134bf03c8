"""``gridshard train``: the command, then the training itself — as one worker under torchrun,
or, outside a launcher, starting the local workers (PyTorch's elastic launcher), watching
them and reporting how they ended; the worker's entry point; and the launcher's SIGINT /
SIGTERM handling (the first stops after the step with a checkpoint, the second at once)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time

import click

from .._stop import ENV as STOP_ENV
from ..errors import ConfigError
from .common import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_WORKER_ERROR
from .failures import failure_message, rank_log_path, stopped_at_message, stopped_message, write_rank_log
from .preflight import _resolve_for_launch
from .run_dir import _owns_run_dir, _restarted


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="[CONFIG] [key.sub=value ...]")
@click.option("--nproc", type=int, default=None,
              help="Local worker processes to start (default: parallel.data × pipeline × tensor). "
                   "Ignored under torchrun, where WORLD_SIZE decides.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Where metrics.jsonl and config.yaml go (default: runs/<timestamp>).")
@click.option("--resume", "resume", default=None, metavar="PATH|latest",
              help="Continue from a checkpoint: 'latest' (the newest complete one under RUN_DIR/checkpoints), a "
                   "step_N folder or a run directory. Same as train.resume=PATH; any layout may read it.")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="Restart all workers up to N times after a failure; each restart resumes from the latest "
                   "complete checkpoint (PyTorch's elastic agent). Under torchrun, pass it to torchrun instead.")
@click.option("--overwrite", is_flag=True, help="Start over in a run directory that already holds a run (its "
              "metrics, per-rank timings, checkpoints, logs, traces and TensorBoard files are removed first). "
              "Refused while that run is live.")
@click.option("--allow-changed-schedule", is_flag=True, help="With --resume: accept a learning-rate schedule "
              "(lr, min_lr, warmup_steps, schedule, decay_steps, or steps as the decay's end) that changes the "
              "steps still to run; the change is named in the resume log. Same as train.allow_changed_schedule=true.")
@click.option("--check", is_flag=True, help="Validate, print the resolved config and the predicted peak memory "
              "per rank; start nothing.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics are still written).")
def train(args, nproc, run_dir, resume, max_restarts, overwrite, allow_changed_schedule, check, no_progress):
    """Train the model described by CONFIG (a YAML file; none = built-in default).

    \b
    Overrides use dotted keys and YAML values, e.g.
      gridshard train configs/tiny.yaml parallel.data=2 parallel.tensor=2 parallel.tensor_mode=1d train.lr=1e-3
    Keys: parallel.{data,tensor,tensor_mode,sequence_parallel,pipeline}, model.{preset,hidden,...},
    data.{kind,path,token_dtype,seq_len}, train.{global_batch,micro_batch,steps,lr,min_lr,warmup_steps,
    precision,grad_clip,weight_decay,seed,log_interval,...} — see docs/config.md.

    Outside a launcher it starts the workers itself (PyTorch's elastic launcher); under
    torchrun (RANK/WORLD_SIZE set) this process is one worker:

    \b
      torchrun --nproc-per-node 4 -m gridshard train CONFIG
    """
    from ..launch import under_launcher

    launched = under_launcher()
    try:
        resolved, run_dir, memory_line = _resolve_for_launch(args, nproc, run_dir, resume, max_restarts, overwrite,
                                                             allow_changed_schedule, check, launched)
    except ConfigError as e:
        if _owns_run_dir(launched):      # under torchrun: one message, from rank 0
            click.echo(f"config error: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    if check:
        import yaml

        click.echo(yaml.safe_dump(resolved.config.resolved(), sort_keys=False).rstrip())
        click.echo(f"# ok for {resolved.world_size} process(es)")
        click.echo(f"# {memory_line}")
        return
    if _owns_run_dir(launched):
        click.echo(f"gridshard: {memory_line}")        # stdout, like the summary: stderr is for trouble
    if launched:
        _train_as_worker(resolved, run_dir, not no_progress)
    else:
        _train_local_workers(resolved, run_dir, not no_progress, max_restarts)


def restart_config(resolved, run_dir: str):
    """A restarted elastic worker (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the run
    directory's latest complete checkpoint (``train.resume=auto``) when there is one.
    ``resolved``: the launcher's :class:`gridshard.engine.job.ResolvedConfig`."""
    from ..checkpoint import checkpoints_root, read_latest

    if not _restarted() or read_latest(checkpoints_root(run_dir)) is None:
        return resolved
    # a resume source is checked when the job is built, not by validation
    train = resolved.config.train.model_copy(update={"resume": "auto"})
    return dataclasses.replace(resolved, config=resolved.config.model_copy(update={"train": train}))


def _run(resolved, run_dir: str, progress: bool):
    """This worker's training: its losses, or ``{"stopped_at": step, "checkpoint": folder}`` when
    a stop request (Ctrl-C; SIGINT forwarded by the launcher or torchrun) ended it after a step
    with a checkpoint (gridshard.engine.control)."""
    from ..engine.control import TrainingStopped, install_stop_handler
    from ..engine.trainer import train as run_training

    install_stop_handler()
    try:
        return run_training(restart_config(resolved, run_dir), run_dir=run_dir, progress=progress)
    except TrainingStopped as stopped:
        return {"stopped_at": stopped.step, "checkpoint": stopped.checkpoint}


def _worker(resolved, run_dir: str, progress: bool):
    """Entry point of one elastic worker: join the group, train, return the losses (rank 0).
    ``resolved``: the config the launcher validated for this world size
    (:class:`gridshard.engine.job.ResolvedConfig`), used as it is — not loaded again."""
    import torch.distributed as dist

    from ..engine.control import Heartbeat
    from ..mesh import init_distributed

    rank = int(os.environ.get("RANK", "0"))
    # SIGTERM (the elastic agent stopping the survivors of a failure): end at once, without a
    # traceback; metrics lines are appended whole and checkpoints renamed into place when complete,
    # so what is on disk stays consistent. (SIGINT is a stop request from the worker's first line:
    # gridshard/_stop.py.)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_INTERRUPTED))
    heartbeat = Heartbeat(run_dir, rank)        # names a stalled rank if the job fails (failure_message)
    try:
        init_distributed(resolved.config.parallel.backend, timeout_s=resolved.config.train.collective_timeout_s,
                         run_dir=run_dir)
        result = _run(resolved, run_dir, progress)
        dist.barrier()  # gloo may abort a rank that tears down while a peer is still mid-collective
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - every error becomes one line + a log file
        write_rank_log(run_dir, rank, e)
        sys.exit(EXIT_WORKER_ERROR)
    finally:
        heartbeat.stop()
    return result if rank == 0 else None


def _report(result, run_dir: str, wall_s: float) -> None:
    """The last word of a run: "stopped at step N" (exit 130) when a stop request ended it, else
    the summary of its losses."""
    if isinstance(result, dict):
        click.echo(stopped_at_message(result["stopped_at"], result["checkpoint"], run_dir), err=True)
        sys.exit(EXIT_INTERRUPTED)
    known = [x for x in result or () if x is not None]      # None: a step without valid targets
    if known:
        click.echo(f"done: {len(result)} steps, loss {known[0]:.4f} -> {known[-1]:.4f} "
                   f"({known[-1] / known[0]:.2f}x) in {wall_s:.1f} s; run dir {run_dir} "
                   f"(metrics.jsonl, config.yaml; `gridshard plot {run_dir}`)")


def _train_as_worker(resolved, run_dir: str, progress: bool) -> None:
    """Under torchrun: this process is one worker; rank 0 reports. A gridshard error (a rank missing
    at the rendezvous, a collective timeout, divergence, a failed save) ends it with one line naming
    the rank; the traceback goes to ``RUN_DIR/logs/rank_N.log``."""
    from ..errors import GridshardError

    t0 = time.perf_counter()
    try:
        result = _run(resolved, run_dir, progress)
    except GridshardError as e:
        rank = int(os.environ.get("RANK", "0"))
        write_rank_log(run_dir, rank, e)
        click.echo(f"gridshard: rank {rank}: {e} (traceback: {rank_log_path(run_dir, rank)})", err=True)
        sys.exit(EXIT_WORKER_ERROR)
    if int(os.environ.get("RANK", "0")) == 0:
        _report(result, run_dir, time.perf_counter() - t0)
    elif isinstance(result, dict):
        sys.exit(EXIT_INTERRUPTED)


def _train_local_workers(resolved, run_dir: str, progress: bool, max_restarts: int) -> None:
    """Outside a launcher: start the workers (PyTorch's elastic launcher), watch them, report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..engine.control import StallWatchdog, clear_heartbeats, stalled_ranks
    from ..launch import launch_local

    t0 = time.perf_counter()
    world, timeout_s = resolved.world_size, resolved.config.train.collective_timeout_s
    clear_heartbeats(run_dir)
    interrupts = _LauncherInterrupts()
    watchdog = StallWatchdog(run_dir, world, timeout_s)
    try:
        with interrupts, watchdog:
            results = launch_local(world, _worker, resolved, run_dir, progress,
                                   max_restarts=max_restarts, agent_signals=_LauncherInterrupts.AGENT_SIGNALS)
    except ChildFailedError as e:
        if interrupts.count or all(f.exitcode == EXIT_INTERRUPTED or f.signal_name() in ("SIGINT", "SIGTERM")
                                   for f in e.failures.values()):
            click.echo(stopped_message(run_dir, aborted=interrupts.count > 1), err=True)
            sys.exit(EXIT_INTERRUPTED)
        stalled = watchdog.killed or stalled_ranks(run_dir, world, timeout_s)
        click.echo(failure_message(e, run_dir, stalled=stalled, timeout_s=timeout_s), err=True)
        sys.exit(EXIT_FAILED if stalled or not any(f.exitcode == EXIT_WORKER_ERROR for f in e.failures.values())
                 else EXIT_WORKER_ERROR)
    except (KeyboardInterrupt, SignalException):
        click.echo(stopped_message(run_dir, aborted=interrupts.count > 1), err=True)
        sys.exit(EXIT_INTERRUPTED)
    _report(results.get(0), run_dir, time.perf_counter() - t0)


class _LauncherInterrupts:
    """SIGINT / SIGTERM to the ``gridshard train`` launcher while its workers run. The first asks
    the workers to stop after the current step and checkpoint (SIGINT to each; a terminal's
    Ctrl-C has reached them already, a repeat is ignored) and lets the elastic agent wait for
    them; the second kills them at once (SIGKILL) and ends the launch. The agent's own handler
    (forward the signal, wait ``shutdown_timeout``, kill) is kept for SIGHUP and SIGQUIT."""

    AGENT_SIGNALS = "SIGHUP,SIGQUIT"

    def __init__(self):
        self.count = 0
        self._previous = {}

    def __enter__(self):
        self._env = os.environ.get(STOP_ENV)
        os.environ[STOP_ENV] = "1"                 # the workers spawned from here (gridshard/_stop.py)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._env is None:
            os.environ.pop(STOP_ENV, None)
        else:
            os.environ[STOP_ENV] = self._env
        return False

    def _handle(self, signum, frame):
        import multiprocessing

        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.count += 1
        if self.count == 1:
            os.write(2, b"\ngridshard: stopping after the current step, then writing a checkpoint "
                        b"(Ctrl-C again to stop at once, without one)\n")
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGINT if self.count == 1 else signal.SIGKILL)
        if self.count > 1:
            raise SignalException(f"gridshard launcher got {signal.Signals(signum).name} twice",
                                  signal.Signals(signum))
