"""The ``gridshard`` click group: ``--help``, ``--version`` and its commands (train:
gridshard/cli/train.py; the others: gridshard/cli/commands.py)."""
from __future__ import annotations

import click

from .commands import diagnose, emulate, export, generate, plan, plot, predict, prepare_data
from .train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gridshard", prog_name="gridshard", message="%(prog)s %(version)s")
def main():
    """gridshard: train transformers with data, 1D/2D tensor parallelism from one YAML config.

    \b
    Quick start (4 local CPU workers, under a minute, tiny model on Python's own source):
      gridshard train --nproc 4 --run-dir runs/default
      gridshard plot runs/default
    """


for command in (train, plan, emulate, export, plot, diagnose, generate, predict, prepare_data):
    main.add_command(command)
