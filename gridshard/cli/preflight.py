"""Every check of ``gridshard train`` before a worker starts: the config against the world
size (``--nproc``, or ``WORLD_SIZE`` under torchrun), the local processes against this
machine, the predicted peak memory per rank, the checkpoint to resume from, and the run
directory (gridshard/cli/run_dir.py), which is claimed only once all have passed. Each
refusal is a ConfigError."""
from __future__ import annotations

import os

import click

from ..errors import ConfigError
from .common import _split_args
from .run_dir import _check_not_live, _check_run_dir, _claim_run_dir, _copy_tokenizer, _owns_run_dir, default_run_dir


def _resolve_for_launch(args, nproc, run_dir, resume, max_restarts, overwrite, allow_changed_schedule, check,
                        launched):
    """Every check before a worker starts (ConfigError on the first that fails); returns the
    config resolved for the world size (:class:`gridshard.engine.job.ResolvedConfig`, what the
    workers get), the run directory and the predicted-memory line. Unless ``check``, the run
    directory is created and locked."""
    from ..config import load_config, resolve_config
    from ..config.validate import check_before_launch, user_sets
    from ..device import resolve_backend
    from ..engine.job import ResolvedConfig

    if not check and run_dir is not None:
        _check_not_live(run_dir, overwrite, launched)           # first: the one reason that matters then
    source, overrides = _split_args(args)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts} is invalid: it counts restarts. Fix: 0 or more.")
    if resume is not None:
        from ..checkpoint import resolve_checkpoint

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
    from ..config import load_config
    from ..device import check_ranks_per_node
    from ..launch import launcher_world_size

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


def _check_local_processes(world: int, asked: bool, backend: str = "auto") -> None:
    """Local workers of ``parallel.backend`` = ``backend``. nccl: refused beyond one per visible
    GPU (:func:`gridshard.device.check_ranks_per_node`). gloo (CPU): beyond the machine's cores,
    a warning when the user asked for them with --nproc; refused when only the config asks for
    more than 4 per core (a cluster config such as configs/llama_7b.yaml run by mistake on a
    laptop)."""
    from ..device import check_ranks_per_node, resolve_backend

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


def _check_memory(cfg, world: int, launched: bool) -> str:
    """The predicted peak memory per rank against this machine's (gridshard.planner.fit): the
    line to print, or ConfigError naming the nearest layout that fits."""
    from ..device import resolve_backend
    from ..planner import fit

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
    from ..checkpoint.hf_io import is_gridshard_checkpoint
    from ..checkpoint.reader import open_checkpoint
    from ..checkpoint.resume import check_compatible, describe, resume_folder

    share = (0, 0) if launched else (0, 1)
    folder = resume_folder(cfg.train.resume, run_dir)
    if folder is not None:
        checked = open_checkpoint(folder, hash_share=share)
        check_compatible(checked.meta["config"], cfg.resolved(), describe(folder), start_step=checked.step)
    elif cfg.model.init_from is not None and is_gridshard_checkpoint(cfg.model.init_from):
        open_checkpoint(cfg.model.init_from, hash_share=share)
