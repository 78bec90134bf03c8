"""The ``gridshard`` command line.

    gridshard train [CONFIG] [--nproc N] [--run-dir DIR] [key.sub=value ...]
    gridshard plot RUN_DIR [--out DIR]

``train`` validates the whole config against the world size first (``--nproc``, or
``WORLD_SIZE`` under torchrun) and exits with status 2 and one message on a bad
config, before any worker starts.
"""
from __future__ import annotations

import os
import sys
import time

import click

from .errors import ConfigError

EXIT_CONFIG = 2


def _split_args(args):
    overrides = [a for a in args if "=" in a]
    configs = [a for a in args if "=" not in a]
    if len(configs) > 1:
        raise ConfigError(f"more than one CONFIG given: {configs}. Fix: pass one YAML file; write overrides as "
                          f"key.sub=value.")
    return (configs[0] if configs else None), overrides


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def _worker(config_dict: dict, run_dir: str, progress: bool):
    """Entry point of one elastic worker: join the group, train, return the losses (rank 0)."""
    import torch.distributed as dist

    from .engine.trainer import train as run_training
    from .mesh import init_distributed

    init_distributed()
    losses = run_training(config_dict, run_dir=run_dir, progress=progress)
    rank = dist.get_rank()
    dist.barrier()  # gloo may abort a rank that tears down while a peer is still mid-collective
    dist.destroy_process_group()
    return losses if rank == 0 else None


def _summary(losses, run_dir, wall_s):
    known = [x for x in losses or () if x is not None]      # None: a step without valid targets
    if known:
        click.echo(f"done: {len(losses)} steps, loss {known[0]:.4f} -> {known[-1]:.4f} "
                   f"({known[-1] / known[0]:.2f}x) in {wall_s:.1f} s; run dir {run_dir} "
                   f"(metrics.jsonl, config.yaml; `gridshard plot {run_dir}`)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--check", is_flag=True, help="Validate and print the resolved config; start nothing.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics are still written).")
def train(args, nproc, run_dir, check, no_progress):
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
    import torch

    from .config import load_config, resolve_config
    from .launch import launch_local, launcher_world_size, under_launcher

    launched = under_launcher()
    try:
        source, overrides = _split_args(args)
        if launched:
            world = launcher_world_size()
        elif nproc is not None:
            world = nproc
            if world < 1:
                raise ConfigError(f"--nproc={world} is invalid: at least one worker is needed. Fix: --nproc 1 or more.")
        else:
            world = load_config(source, overrides).world_size
        cfg = resolve_config(source, overrides, world_size=world, cuda_available=torch.cuda.is_available())
    except ConfigError as e:
        if not launched or os.environ.get("RANK") == "0":      # under torchrun: one message, from rank 0
            click.echo(f"config error: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    if check:
        import yaml

        click.echo(yaml.safe_dump(cfg.resolved(), sort_keys=False).rstrip())
        click.echo(f"# ok for {world} process(es)")
        return
    run_dir = run_dir or default_run_dir()
    t0 = time.perf_counter()
    if launched:
        from .engine.trainer import train as run_training

        losses = run_training(cfg.model_dump(), run_dir=run_dir, progress=not no_progress)
        if int(os.environ.get("RANK", "0")) == 0:
            _summary(losses, run_dir, time.perf_counter() - t0)
        return
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        results = launch_local(world, _worker, cfg.model_dump(), run_dir, not no_progress)
    except ChildFailedError as e:
        click.echo(f"training failed on a worker:\n{e}", err=True)
        sys.exit(1)
    _summary(results.get(0), run_dir, time.perf_counter() - t0)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Folder for the PNGs (default: RUN_DIR).")
def plot(run_dir, out):
    """Write loss.png and throughput.png for RUN_DIR (from its metrics.jsonl)."""
    from .plot import plot_run

    try:
        paths = plot_run(run_dir, out)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    for p in paths:
        click.echo(p)


if __name__ == "__main__":
    main()
