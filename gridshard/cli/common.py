"""What the ``gridshard`` commands share: the exit statuses, the split of CONFIG from its
``key.sub=value`` overrides, and a refusal (ConfigError) as one line and exit status 2."""
from __future__ import annotations

import contextlib
import sys

import click

from ..errors import ConfigError

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
