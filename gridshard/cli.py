"""The ``gridshard`` command line.

    gridshard train [CONFIG] [--nproc N] [--run-dir DIR] [--resume PATH|latest] [--max-restarts N]
                    [--overwrite] [key.sub=value ...]
    gridshard export CKPT_DIR --to hf OUT_DIR
    gridshard plan [CONFIG] --gpus N [--nodes K] [--hardware NAME|PROFILE.json] [--top K] [--json] [--write OUT.yaml]
                   [--explain] [key.sub=value ...];  gridshard plan --calibrate [--nproc N] [--out PROFILE.json]
    gridshard plot RUN_DIR [--out DIR]
    gridshard prepare-data INPUT... --out DIR [--train-tokenizer --vocab-size N | --tokenizer FILE | --bytes]
                           [--overwrite]
    gridshard generate RUN_DIR|CKPT_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S]

``train`` validates the whole config against the world size first (``--nproc``, or
``WORLD_SIZE`` under torchrun) — and, when resuming, the checkpoint's completeness and
compatibility — and exits with status 2 and one message on a bad config, before any
worker starts. A worker that dies ends the job with status 1 and a message naming the
rank and the last complete checkpoint. A run directory belongs to one live run: the launcher (rank 0
under torchrun) locks ``RUN_DIR/.gridshard.lock`` for the life of the job and a second ``train``
into it is refused, ``--overwrite`` included (gridshard/run_lock.py); the launcher's workers die
with it, SIGKILL included (gridshard/parent_death.py). A refused command creates nothing.

Exit status: 0 done; 2 refused before any worker started (config, data, run directory);
1 a worker died (signal), stalled (named from its heartbeat and killed after
``train.collective_timeout_s``) or the job failed after launch; 3 a worker raised an error —
one line names the rank and the cause, the traceback is in ``RUN_DIR/logs/rank_N.log``;
130 interrupted (Ctrl-C / SIGINT / SIGTERM): the current step ends, a checkpoint of it is
written, "stopped at step N; checkpoint ...", no traceback; a second Ctrl-C stops at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback

import click

from ._stop import ENV as STOP_ENV
from .errors import ConfigError

EXIT_CONFIG = 2
EXIT_FAILED = 1
EXIT_WORKER_ERROR = 3
EXIT_INTERRUPTED = 130


def _split_args(args):
    overrides = [a for a in args if "=" in a]
    configs = [a for a in args if "=" not in a]
    if len(configs) > 1:
        raise ConfigError(f"more than one CONFIG given: {configs}. Fix: pass one YAML file; write overrides as "
                          f"key.sub=value.")
    return (configs[0] if configs else None), overrides


@contextlib.contextmanager
def _refused_as(prefix: str = "error: "):
    """A ConfigError inside becomes one line ``prefix + message`` on stderr and exit status 2."""
    try:
        yield
    except ConfigError as e:
        click.echo(f"{prefix}{e}", err=True)
        sys.exit(EXIT_CONFIG)


def _owns_run_dir(launched: bool) -> bool:
    """The process that speaks for the job and takes the run-directory lock (gridshard/run_lock.py):
    the local launcher, or rank 0 under torchrun (one per job, also across nodes)."""
    return not launched or os.environ.get("RANK") == "0"


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def restart_config(resolved, run_dir: str):
    """A restarted elastic worker (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the run
    directory's latest complete checkpoint (``train.resume=auto``) when there is one.
    ``resolved``: the launcher's :class:`gridshard.engine.job.ResolvedConfig`."""
    from .checkpoint import checkpoints_root, read_latest

    if not _restarted() or read_latest(checkpoints_root(run_dir)) is None:
        return resolved
    return resolved.with_train(resume="auto")


def _worker(resolved, run_dir: str, progress: bool):
    """Entry point of one elastic worker: join the group, train, return the losses (rank 0).
    ``resolved``: the config the launcher validated for this world size
    (:class:`gridshard.engine.job.ResolvedConfig`), used as it is — not loaded again."""
    import torch.distributed as dist

    from .engine.control import Heartbeat, TrainingStopped, install_stop_handler
    from .engine.trainer import train as run_training
    from .mesh import init_distributed

    rank = int(os.environ.get("RANK", "0"))
    # Ctrl-C (SIGINT from the terminal, forwarded once more by the launcher): finish the step, all
    # ranks agree on it, checkpoint, return (gridshard.engine.control). SIGTERM (the elastic agent
    # stopping the survivors of a failure): end at once, without a traceback; metrics lines are
    # appended whole and checkpoints renamed into place when complete, so what is on disk stays
    # consistent.
    install_stop_handler()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_INTERRUPTED))
    heartbeat = Heartbeat(run_dir, rank)        # names a stalled rank if the job fails (failure_message)
    try:
        init_distributed(resolved.config.parallel.backend, timeout_s=resolved.config.train.collective_timeout_s)
        try:
            losses = run_training(restart_config(resolved, run_dir), run_dir=run_dir, progress=progress)
        except TrainingStopped as stopped:
            losses = {"stopped_at": stopped.step, "checkpoint": stopped.checkpoint}
        dist.barrier()  # gloo may abort a rank that tears down while a peer is still mid-collective
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - every error becomes one line + a log file
        write_rank_log(run_dir, rank, e)
        sys.exit(EXIT_WORKER_ERROR)
    finally:
        heartbeat.stop()
    return losses if rank == 0 else None


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


def _summary(losses, run_dir, wall_s):
    known = [x for x in losses or () if x is not None]      # None: a step without valid targets
    if known:
        click.echo(f"done: {len(losses)} steps, loss {known[0]:.4f} -> {known[-1]:.4f} "
                   f"({known[-1] / known[0]:.2f}x) in {wall_s:.1f} s; run dir {run_dir} "
                   f"(metrics.jsonl, config.yaml; `gridshard plot {run_dir}`)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gridshard", prog_name="gridshard", message="%(prog)s %(version)s")
def main():
    """gridshard: train transformers with data, 1D/2D tensor parallelism from one YAML config.

    \b
    Quick start (4 local CPU workers, under a minute, tiny model on Python's own source):
      gridshard train --nproc 4 --run-dir runs/default
      gridshard plot runs/default
    """


@main.command(context_settings={"ignore_unknown_options": True})
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
              "metrics, checkpoints, logs and TensorBoard files are removed first). Refused while that run is live.")
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
    from .launch import under_launcher

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


def _resolve_for_launch(args, nproc, run_dir, resume, max_restarts, overwrite, allow_changed_schedule, check,
                        launched):
    """Every check before a worker starts (ConfigError on the first that fails); returns the
    config resolved for the world size (:class:`gridshard.engine.job.ResolvedConfig`, what the
    workers get), the run directory and the predicted-memory line. Unless ``check``, the run
    directory is created and locked."""
    from .config import load_config, resolve_config
    from .config.validate import check_before_launch, user_sets
    from .device import resolve_backend
    from .engine.job import ResolvedConfig

    if not check and run_dir is not None:
        _check_not_live(run_dir, overwrite, launched)           # first: the one reason that matters then
    source, overrides = _split_args(args)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts} is invalid: it counts restarts. Fix: 0 or more.")
    if resume is not None:
        from .checkpoint import resolve_checkpoint

        overrides = [*overrides, f"train.resume={resolve_checkpoint(resume, run_dir)}"]
    if allow_changed_schedule:                      # a train key: the workers get the resolved config
        overrides = [*overrides, "train.allow_changed_schedule=true"]
    world = _world_size(launched, nproc, source, overrides)
    cuda = resolve_backend(load_config(source, overrides).parallel.backend) == "nccl"    # gridshard/device.py
    cfg = resolve_config(source, overrides, world_size=world, cuda_available=cuda)
    run_dir = run_dir or default_run_dir()
    check_before_launch(cfg, warmup_set=user_sets(source, overrides, "train", "warmup_steps"))
    memory_line = _check_memory(cfg, world, launched)
    if not check:
        _check_run_dir(run_dir, cfg, overwrite, launched)      # looks only: a refusal creates nothing
    _check_resume(cfg, run_dir, launched)
    if not check:       # every check is above: from here on the run directory is created and locked
        _claim_run_dir(run_dir, cfg, overwrite, launched)
    if not check and _owns_run_dir(launched):
        _copy_tokenizer(cfg, run_dir)
    return ResolvedConfig(cfg, world, cuda), run_dir, memory_line


def _world_size(launched: bool, nproc, source, overrides) -> int:
    """The launcher's world (torchrun), ``--nproc``, or the config's D·P·T."""
    from .config import load_config
    from .device import check_ranks_per_node
    from .launch import launcher_world_size

    if not launched and nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc={nproc} is invalid: at least one worker is needed. Fix: --nproc 1 or more.")
    cfg = load_config(source, overrides)
    world = launcher_world_size() if launched else nproc if nproc is not None else cfg.world_size
    backend = cfg.parallel.backend
    if launched:
        check_ranks_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend, "--nproc-per-node")
    else:
        _check_local_processes(world, nproc is not None, backend)
    return world


def _train_as_worker(resolved, run_dir: str, progress: bool) -> None:
    """Under torchrun: this process is one worker; rank 0 prints the summary."""
    from .engine.control import TrainingStopped, install_stop_handler
    from .engine.trainer import train as run_training

    t0 = time.perf_counter()
    install_stop_handler()            # torchrun forwards SIGINT: stop after the step, checkpoint
    try:
        losses = run_training(restart_config(resolved, run_dir), run_dir=run_dir, progress=progress)
    except TrainingStopped as stopped:
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(stopped_at_message(stopped.step, stopped.checkpoint, run_dir), err=True)
        sys.exit(EXIT_INTERRUPTED)
    if int(os.environ.get("RANK", "0")) == 0:
        _summary(losses, run_dir, time.perf_counter() - t0)


def _train_local_workers(resolved, run_dir: str, progress: bool, max_restarts: int) -> None:
    """Outside a launcher: start the workers (PyTorch's elastic launcher), watch them, report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .engine.control import StallWatchdog, clear_heartbeats, stalled_ranks
    from .launch import launch_local

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
    first = results.get(0)
    if isinstance(first, dict) and "stopped_at" in first:
        click.echo(stopped_at_message(first["stopped_at"], first["checkpoint"], run_dir), err=True)
        sys.exit(EXIT_INTERRUPTED)
    _summary(first, run_dir, time.perf_counter() - t0)


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
        workers = multiprocessing.active_children()
        if self.count == 1:
            os.write(2, b"\ngridshard: stopping after the current step, then writing a checkpoint "
                        b"(Ctrl-C again to stop at once, without one)\n")
            for p in workers:
                _signal_quietly(p.pid, signal.SIGINT)
            return
        for p in workers:
            _signal_quietly(p.pid, signal.SIGKILL)
        raise SignalException(f"gridshard launcher got {signal.Signals(signum).name} twice", signal.Signals(signum))


def _signal_quietly(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _check_local_processes(world: int, asked: bool, backend: str = "auto") -> None:
    """Local workers of ``parallel.backend`` = ``backend``. nccl: refused beyond one per visible
    GPU (:func:`gridshard.device.check_ranks_per_node`). gloo (CPU): beyond the machine's cores,
    a warning when the user asked for them with --nproc; refused when only the config asks for
    more than 4 per core (a cluster config such as configs/llama_7b.yaml run by mistake on a
    laptop)."""
    from .device import check_ranks_per_node, resolve_backend

    if resolve_backend(backend) == "nccl":
        check_ranks_per_node(world, backend, "--nproc")
        return
    slots, what = os.cpu_count() or 1, "CPU cores"
    if world <= slots:
        return
    if not asked and world > 4 * slots:
        raise ConfigError(f"the config's layout needs {world} processes and this machine has {slots} {what}: "
                          f"gridshard does not start {world} local workers unasked. Fix: launch it with torchrun on "
                          f"the machines it is meant for, choose a smaller layout, or pass --nproc {world} to start "
                          f"them here anyway.")
    click.echo(f"warning: {world} worker processes on {slots} {what}: they share the {what} (gloo: fine for "
               f"checks and tests, slow for training)", err=True)


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "logs", "tb")


def _check_not_live(run_dir: str, overwrite: bool, launched: bool) -> None:
    """Refuse a run directory whose lock a live run holds (:mod:`gridshard.run_lock`), naming
    its PID and host; ``--overwrite`` included. Looked at by the process that would take the lock
    (the others of a torchrun job would see their own rank 0's), except in an elastic restart,
    whose dead predecessor may still hold it (:func:`_claim_run_dir` waits for that one)."""
    from .run_lock import in_use_message, live_holder

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
    from .fsutil import cannot_create

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
    from .fsutil import make_dirs, remove_made
    from .run_lock import acquire

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


def _check_memory(cfg, world: int, launched: bool) -> str:
    """The predicted peak memory per rank against this machine's (gridshard.planner.fit): the
    line to print, or ConfigError naming the nearest layout that fits."""
    from .device import resolve_backend
    from .planner import fit

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world
    cuda = resolve_backend(cfg.parallel.backend) == "nccl"
    return fit.check_memory(cfg, world, fit.machine_budget(local, cuda=cuda))


def _check_resume(cfg, run_dir: str, launched: bool = False) -> None:
    """Before any worker starts: the checkpoint to resume from (or a gridshard checkpoint
    named by ``model.init_from``) verifies completely — manifest sizes *and* sha256, meta.json
    against the tensors, DCP's index tensors only (:func:`gridshard.checkpoint.reader.open_checkpoint`)
    — and is compatible with the config. A damaged one is refused here, exit 2, naming the
    newest checkpoint that verifies, instead of failing in every worker after launch. Under
    torchrun (``launched``: every rank runs this) only sizes are checked here, so the ranks do
    not all hash the same files; the workers then verify the hashes together, each a share."""
    from .checkpoint.hf_io import is_gridshard_checkpoint
    from .checkpoint.reader import open_checkpoint
    from .checkpoint.resume import check_compatible, describe, resume_folder

    share = (0, 0) if launched else (0, 1)
    folder = resume_folder(cfg.train.resume, run_dir)
    if folder is not None:
        checked = open_checkpoint(folder, hash_share=share)
        check_compatible(checked.meta["config"], cfg.resolved(), describe(folder), start_step=checked.step)
    elif cfg.model.init_from is not None and is_gridshard_checkpoint(cfg.model.init_from):
        open_checkpoint(cfg.model.init_from, hash_share=share)


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
    from .checkpoint.files import CheckpointError, checkpoints_root, complete_steps, newest_verified, read_latest

    root = checkpoints_root(run_dir)
    good = newest_verified(root)
    if good is None:
        return (f"no checkpoint under {root} verifies (start afresh)" if complete_steps(root)
                else "no complete checkpoint was written")
    try:
        latest = read_latest(root)
    except CheckpointError:                            # a `latest` gridshard did not write: name the folder
        latest = None
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
    died = [(r, f) for r, f in sorted(error.failures.items()) if f.exitcode != EXIT_WORKER_ERROR or r not in raised]
    if stalled:
        names = ", ".join(f"rank {r} (silent for its last {s:.0f} s)" for r, s in stalled)
        them = "it" if len(stalled) == 1 else "them"
        line = (f"training failed: {names} stopped answering (stopped, hung or swapped out; no heartbeat in "
                f"{os.path.join(run_dir, 'logs')}): the other ranks waited for {them} in a collective for "
                f"train.collective_timeout_s={timeout_s:g} s, then gave up; "
                f"{'it was' if len(stalled) == 1 else 'they were'} killed")
        if raised:
            rank = min(raised, key=lambda r: (raised[r][0], r))
            line += f" (rank {rank}: {raised[rank][1][:200]}; traceback: {rank_log_path(run_dir, rank)})"
        lines = [line]
    elif raised:
        rank = min(raised, key=lambda r: (raised[r][0], r))
        lines = [f"training failed: rank {rank}: {raised[rank][1]} (traceback: {rank_log_path(run_dir, rank)})"]
    else:
        lines = ["training failed:"]
        for rank, f in died:
            how = f"died ({f.signal_name()})" if f.exitcode < 0 else f"failed (exit code {f.exitcode})"
            if f.exitcode == EXIT_WORKER_ERROR:        # raised, but its log could not be written
                lines.append(f"  rank {rank} raised an error; its log {rank_log_path(run_dir, rank)} could not be "
                             f"written (full or read-only disk?): the cause is the 'gridshard: rank {rank}:' line "
                             f"above")
                continue
            lines.append(f"  rank {rank} {how}" + (f": {f.message}" if f.exitcode >= 0 and f.message else ""))
    lines.append(last_good_checkpoint(run_dir))
    return "\n".join(lines)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="[CONFIG] [key.sub=value ...]")
@click.option("--gpus", type=int, default=None, help="Devices N to plan for (default: the config's D×P×T).")
@click.option("--nodes", type=int, default=None, help="Nodes the N devices are spread over (default: ⌈N / devices "
              "per node of --hardware⌉).")
@click.option("--hardware", default="cpu", show_default=True,
              help="h100 | h200 | a100 | cpu | calibrated | PROFILE.json (from --calibrate).")
@click.option("--top", type=int, default=10, show_default=True, help="Layouts to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the layouts as a JSON list, best first.")
@click.option("--write", type=click.Path(dir_okay=False), default=None,
              help="Write the input config with the best layout's parallel:/train: keys to this YAML file.")
@click.option("--explain", "explain_flag", is_flag=True, help="Say why the top layout wins.")
@click.option("--calibrate", "calibrate_flag", is_flag=True, help="Measure this machine (GEMM, memory, "
              "collectives over --nproc local ranks) and write a profile for --hardware.")
@click.option("--nproc", type=int, default=4, show_default=True, help="Ranks for --calibrate.")
@click.option("--out", default="gridshard-profile.json", show_default=True, help="Profile file of --calibrate.")
def plan(args, gpus, nodes, hardware, top, as_json, write, explain_flag, calibrate_flag, nproc, out):
    """Rank every layout of CONFIG on N devices by predicted step time (docs/planner.md).

    \b
      gridshard plan configs/tiny.yaml --gpus 8 --explain
      gridshard plan --gpus 64 --nodes 8 --hardware h100 model.preset=7b data.seq_len=4096
      gridshard plan --calibrate --nproc 4 --out cpu.json && gridshard plan --gpus 4 --hardware cpu.json
    """
    from .planner.command import run_calibrate, run_plan

    with _refused_as("gridshard plan: "):
        source, overrides = _split_args(args)
        if calibrate_flag:
            run_calibrate(nproc, out, overrides)          # parallel.backend=... picks the backend
            return
        run_plan(source, overrides, gpus, nodes, hardware, top, as_json, write, explain_flag)


@main.command()
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.option("--to", "fmt", type=click.Choice(["hf"]), required=True, help="Output format: hf (safetensors + "
              "config.json for transformers' LlamaForCausalLM).")
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(ckpt_dir, fmt, out_dir):
    """Write checkpoint CKPT_DIR (a step_N folder, a run directory or its checkpoints folder) as
    consolidated Hugging Face weights in OUT_DIR."""
    from .checkpoint import resolve_checkpoint
    from .checkpoint.hf_io import export_hf

    with _refused_as():
        paths = export_hf(resolve_checkpoint(ckpt_dir, None), out_dir)
    for p in paths:
        click.echo(p)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Folder for the PNGs (default: RUN_DIR).")
def plot(run_dir, out):
    """Write loss.png and throughput.png for RUN_DIR (from its metrics.jsonl)."""
    from .plot import plot_run

    with _refused_as():
        paths = plot_run(run_dir, out)
    for p in paths:
        click.echo(p)


@main.command()
@click.argument("path", metavar="RUN_DIR|CKPT_DIR", type=click.Path(file_okay=False))
@click.option("--prompt", required=True, help="Text to continue (encoded with the run's tokenizer).")
@click.option("--max-new-tokens", type=int, default=200, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=50, show_default=True, help="Sample among the k most likely ids.")
@click.option("--seed", type=int, default=0, show_default=True)
def generate(path, prompt, max_new_tokens, temperature, top_k, seed):
    """Sample a continuation of --prompt from the model in RUN_DIR (its latest checkpoint) or in
    CKPT_DIR, in one process whatever layout trained it; prints the prompt and its continuation."""
    from .generate import generate_text

    with _refused_as():                          # a CheckpointError is a ConfigError
        prompt, text, folder, step = generate_text(path, prompt, max_new_tokens, temperature, top_k, seed)
    click.echo(f"# {folder} (step {step}), temperature {temperature}, top-k {top_k}, seed {seed}", err=True)
    click.echo(prompt + text)


@main.command()
@click.argument("path", metavar="RUN_DIR|CKPT_DIR", type=click.Path(file_okay=False))
@click.argument("images", nargs=-1, required=True, metavar="IMAGE...", type=click.Path(dir_okay=False))
@click.option("--top", type=int, default=3, show_default=True, help="Classes printed per image.")
def predict(path, images, top):
    """Print the top classes of each IMAGE by the ViT (model.kind: vit) in RUN_DIR (its latest
    checkpoint) or CKPT_DIR, in one process whatever layout trained it (docs/vision.md)."""
    from .predict import predict_images

    with _refused_as():                          # a CheckpointError is a ConfigError
        folder, step, rows = predict_images(path, list(images), top)
    click.echo(f"# {folder} (step {step})", err=True)
    for image, best in rows:
        click.echo(f"{image}: " + ", ".join(f"{name} {p:.3f}" for name, p in best))


@main.command("prepare-data")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for tokens.bin, meta.json, "
              "doc_starts.npy and tokenizer.json.")
@click.option("--train-tokenizer", is_flag=True, help="Train a byte-level BPE on the input (needs --vocab-size).")
@click.option("--vocab-size", type=int, default=None, help="Vocabulary of the trained BPE, e.g. 4096.")
@click.option("--tokenizer", "tokenizer_file", type=click.Path(dir_okay=False), default=None,
              help="Use an existing Hugging Face tokenizer.json.")
@click.option("--bytes", "use_bytes", is_flag=True, help="The built-in byte tokenizer (vocabulary 256; the default).")
@click.option("--val-fraction", type=float, default=0.01, show_default=True,
              help="Share of the tokens (the end of the stream) held out for validation.")
@click.option("--workers", type=int, default=None, help="Encoding processes (default: all CPU cores).")
@click.option("--tokenizer-bytes", type=int, default=256 << 20, show_default=True,
              help="Train the BPE on the first this-many bytes of the input.")
@click.option("--overwrite", is_flag=True, help="Replace the preparation in a non-empty --out (its meta.json, "
              "tokens.bin, doc_starts.npy and tokenizer.json; other files stay). Without it a non-empty --out is "
              "refused.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def prepare_data(inputs, out, train_tokenizer, vocab_size, tokenizer_file, use_bytes, val_fraction, workers,
                 tokenizer_bytes, overwrite, no_progress):
    """Tokenise text files or folders INPUT... into OUT: a memory-mapped uint16/uint32 token file
    and its metadata (tokenizer, vocabulary, document starts, train/validation split), streaming
    with constant memory, parallel over CPU cores. Then train on it with
    `gridshard train data.kind=prepared data.path=OUT` (the vocabulary size comes from OUT)."""
    from .data.prepare import prepare_data as run

    with _refused_as():
        chosen = [name for name, on in (("--train-tokenizer", train_tokenizer), ("--tokenizer", tokenizer_file),
                                        ("--bytes", use_bytes)) if on]
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)} were both given: they choose the tokenizer. Fix: pass one.")
        if vocab_size is not None and not train_tokenizer:
            raise ConfigError("--vocab-size is only used with --train-tokenizer. Fix: add --train-tokenizer, or "
                              "drop --vocab-size (an existing tokenizer has its own vocabulary).")
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers={workers} is invalid: at least one process encodes. Fix: --workers 1 "
                              f"or more.")
        kind = "train" if train_tokenizer else tokenizer_file or "bytes"
        meta = run(inputs, out, kind, vocab_size, val_fraction, workers, tokenizer_bytes=tokenizer_bytes,
                   progress=not no_progress, overwrite=overwrite)
    mb = meta["input_bytes"] / 1e6
    rss = meta["peak_rss_bytes"]
    (a, b), (c, d) = meta["split"]["train"], meta["split"]["val"]
    click.echo(f"prepared {meta['n_tokens']} tokens ({meta['documents']} documents, vocabulary {meta['vocab_size']}, "
               f"{meta['token_dtype']}) from {mb:.1f} MB in {meta['seconds']:.1f} s "
               f"({mb / max(meta['seconds'], 1e-9):.1f} MB/s, {meta['workers']} workers; peak memory "
               f"{rss['main'] / 2**20:.0f} MiB main, {rss['largest_worker'] / 2**20:.0f} MiB largest worker)\n"
               f"train tokens [{a}, {b}), validation tokens [{c}, {d}) -> {out}\n"
               f"train on it: gridshard train data.kind=prepared data.path={out}")


if __name__ == "__main__":
    main()
