"""The stop-request flag of a training worker (see :mod:`gridshard.engine.control`).

Imported first by ``gridshard/__init__.py``, before torch: a worker process that the
``gridshard train`` launcher spawns (``GRIDSHARD_STOP_ON_SIGINT=1`` in its environment) turns
SIGINT into a stop request from its first line of gridshard on, so a Ctrl-C while the workers
are still importing does not print a KeyboardInterrupt traceback per worker."""
import os
import signal
import threading

ENV = "GRIDSHARD_STOP_ON_SIGINT"
state = {"installed": False, "requested": False}


def _on_sigint(signum, frame) -> None:
    state["requested"] = True                       # repeats: already stopping


def install() -> None:
    signal.signal(signal.SIGINT, _on_sigint)
    state["installed"] = True


def install_early() -> None:
    """In a launched worker (ENV set), handle SIGINT as a stop request from now on."""
    if os.environ.get(ENV) == "1" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
