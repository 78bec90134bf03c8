"""The body of ``gridshard plan`` (``gridshard/cli/commands.py`` only declares the options)."""
from __future__ import annotations

import os

import click

DEFAULT_PROFILE = "gridshard-profile.json"


def resolve_hardware(name: str):
    """``calibrated`` → the profile at $GRIDSHARD_PROFILE or ./gridshard-profile.json."""
    if name == "calibrated":
        path = os.environ.get("GRIDSHARD_PROFILE", DEFAULT_PROFILE)
        if not os.path.isfile(path):
            from ..errors import ConfigError

            raise ConfigError(f"--hardware calibrated: no profile at {path!r}. Fix: run gridshard plan --calibrate "
                              f"--out {path} first, or pass --hardware PROFILE.json.")
        return path
    return name


def run_plan(source, overrides, gpus, nodes, hardware, top, as_json, write, explain_flag, emulate: int = 0) -> None:
    from . import report
    from .search import check_top, plan

    check_top(top)
    result = plan(source, gpus, nodes=nodes, hardware=resolve_hardware(hardware), overrides=overrides)
    click.echo(report.as_json(result, top) if as_json else report.table(result, top))
    if emulate:
        import json

        from .emulate import emulated_plan, format_plan

        rows = emulated_plan(result, emulate)
        click.echo(json.dumps([{k: v for k, v in r.items() if k != "ranks"} for r in rows], indent=1) if as_json
                   else "\n" + format_plan(rows))
    if explain_flag:
        click.echo("")
        click.echo(report.explain(result))
    if write:
        warning = report.write_config(result, write)
        click.echo(f"wrote {write}: {result.best.layout.label()} (gridshard train {write} --nproc {result.world})",
                   err=as_json)
        if warning:
            click.echo(f"warning: {warning}", err=True)


def run_calibrate(nproc: int, out: str, overrides=()) -> None:
    """``gridshard plan --calibrate``; ``overrides``: the command's ``key=value`` arguments, of
    which ``parallel.backend`` (auto | nccl | gloo) picks the backend, as for a job."""
    from .calibrate import calibrate

    backend = dict(o.split("=", 1) for o in overrides).get("parallel.backend", "auto")
    prof = calibrate(nproc=nproc, out=out, backend=backend)
    click.echo(f"wrote {out}: GEMM {prof['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s per rank, "
               f"{prof['compute_slots_per_node']:.2f} ranks compute at once, all-reduce "
               f"{prof['links']['intra']['default']['bandwidth'] / 1e6:.0f} MB/s + "
               f"{prof['links']['intra']['default']['latency_s'] * 1e6:.0f} us; use --hardware {out}")
