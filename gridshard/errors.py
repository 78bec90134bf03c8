"""Error types. Every error names the offending value, the rule it breaks and a fix."""


class GridshardError(Exception):
    """Base class of all gridshard errors."""


class LayoutError(GridshardError, ValueError):
    """A device layout (D, P, T, grid) that cannot be built on this world size."""


class ShapeError(GridshardError, ValueError):
    """A tensor or layer size that the parallel layout cannot split evenly."""


class ConfigError(GridshardError, ValueError):
    """A bad field in a YAML/dict config."""


class CheckpointError(ConfigError, RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, damaged or incompatible with the
    config. A ``ConfigError`` too: it is refused before any worker starts, and the CLI exits
    with status 2 and the one-line message, as for any bad config."""


class NonFiniteError(GridshardError, RuntimeError):
    """Training produced a NaN/inf gradient norm, loss or weights and ``train.on_nonfinite`` is
    ``stop`` (or the weights themselves went bad). The message is one line: the step, the value
    and the last finite checkpoint. Raised alike on every rank."""


class SaveError(GridshardError, RuntimeError):
    """A checkpoint or a run file could not be written (full disk, read-only file system, no
    permission, …). The message is one line naming the run directory, the cause and the last
    complete checkpoint."""


def check_divisible(value: int, divisor: int, what: str, by: str, fix: str = "") -> None:
    """Raise ShapeError unless ``divisor`` divides ``value``.

    ``what`` names the value (e.g. ``"out_features"``), ``by`` names the divisor
    (e.g. ``"tensor-parallel size T"``).
    """
    if divisor <= 0 or value % divisor != 0:
        lo = (value // divisor) * divisor if divisor > 0 else 0
        hi = lo + divisor
        hint = fix or f"use a multiple of {divisor} (e.g. {lo or hi} or {hi}) or change {by}"
        raise ShapeError(
            f"{what}={value} is not divisible by {by}={divisor}: "
            f"{what} must be a multiple of {by}. Fix: {hint}."
        )


def need_package(module: str, message: str, error: type = ConfigError):
    """Import and return the optional ``module``, or raise ``error(message)`` (the message names
    the package and the ``pip install`` fix) when it is not installed."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(message) from None
