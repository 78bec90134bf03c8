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
    directory is created and locked.

    The world: the launcher's (torchrun), ``--nproc``, or the config's D·P·T. Its local processes
    against this machine: nccl refused beyond one per visible GPU
    (:func:`gridshard.device.check_ranks_per_node`); gloo (CPU) as :func:`_check_local_processes`
    says. The predicted peak memory per rank against this machine's (gridshard.planner.fit): the
    line to print, or a ConfigError naming the nearest layout that fits."""
    from ..config import load_config, resolve_config
    from ..config.validate import check_before_launch, user_sets
    from ..device import check_ranks_per_node, resolve_backend
    from ..engine.job import ResolvedConfig
    from ..planner import fit

    if not check and run_dir is not None:
        _check_not_live(run_dir, overwrite, launched)           # first: the one reason that matters then
    source, overrides = _split_args(args)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts} is invalid: it counts restarts. Fix: 0 or more.")
    if not launched and nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc={nproc} is invalid: at least one worker is needed. Fix: --nproc 1 or more.")
    if resume is not None:
        from ..checkpoint import resolve_checkpoint

        overrides = [*overrides, f"train.resume={resolve_checkpoint(resume, run_dir)}"]
    if allow_changed_schedule:                      # a train key: the workers get the resolved config
        overrides = [*overrides, "train.allow_changed_schedule=true"]
    loaded = load_config(source, overrides)
    cuda = resolve_backend(loaded.parallel.backend) == "nccl"    # gridshard/device.py
    world = int(os.environ["WORLD_SIZE"]) if launched else nproc if nproc is not None else loaded.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world
    check_ranks_per_node(local, loaded.parallel.backend, "--nproc-per-node" if launched else "--nproc")
    if not launched and not cuda:
        _check_local_processes(world, nproc is not None)
    cfg = resolve_config(source, overrides, world_size=world, cuda_available=cuda)
    run_dir = run_dir or default_run_dir()
    check_before_launch(cfg, warmup_set=user_sets(source, overrides, "train", "warmup_steps"))
    memory_line = fit.check_memory(cfg, world, fit.machine_budget(local, cuda=cuda))
    if not check:
        _check_run_dir(run_dir, cfg, overwrite, launched)      # looks only: a refusal creates nothing
    _check_resume(cfg, run_dir, launched)
    if not check:       # every check is above: from here on the run directory is created and locked
        _claim_run_dir(run_dir, cfg, overwrite, launched)
    if not check and _owns_run_dir(launched):
        _copy_tokenizer(cfg, run_dir)
    return ResolvedConfig(cfg, world, cuda), run_dir, memory_line


def _check_local_processes(world: int, asked: bool) -> None:
    """``world`` local gloo (CPU) workers: beyond the machine's cores, a warning when the user asked
    for them with --nproc; refused when only the config asks for more than 4 per core (a cluster
    config such as configs/llama_7b.yaml run by mistake on a laptop)."""
    slots = os.cpu_count() or 1
    if world <= slots:
        return
    if not asked and world > 4 * slots:
        raise ConfigError(f"the config's layout needs {world} processes and this machine has {slots} CPU cores: "
                          f"gridshard does not start {world} local workers unasked. Fix: launch it with torchrun on "
                          f"the machines it is meant for, choose a smaller layout, or pass --nproc {world} to start "
                          f"them here anyway.")
    click.echo(f"warning: {world} worker processes on {slots} CPU cores: they share the CPU cores (gloo: fine for "
               f"checks and tests, slow for training)", err=True)


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
