"""Starting the workers of a training job.

* Under ``torchrun`` (or any launcher that sets ``RANK`` and ``WORLD_SIZE``) this process
  *is* one worker: :func:`under_launcher` is true and the CLI trains in-process.
* Otherwise :func:`launch_local` starts ``nproc`` workers on this machine through
  PyTorch's elastic launcher used as a library
  (``torch.distributed.launcher.api.elastic_launch``, the engine behind ``torchrun``):
  c10d rendezvous on a free local port, ``--max-restarts`` restarts, ``spawn`` start method. Each
  worker calls ``entry(*args)``; the launcher sets RANK/WORLD_SIZE/MASTER_ADDR/... and
  the worker's :func:`gridshard.mesh.init_distributed` picks the backend from ``parallel.backend``
  (:mod:`gridshard.device`: auto = nccl on GPUs, gloo otherwise).
  The workers die with the launcher (:mod:`gridshard.parent_death`): each first arms
  ``PR_SET_PDEATHSIG`` = SIGKILL (or a parent-PID watchdog), so a SIGKILLed ``gridshard train``
  leaves no orphan that goes on training and checkpointing.

On CPU the cores are shared out: ``OMP_NUM_THREADS = max(1, cores // nproc)`` unless
the user set it.
"""
from __future__ import annotations

import logging
import os
import uuid

from .netutil import free_port


# After a worker fails, the agent sends SIGTERM to the others and kills (SIGKILL) those still
# alive this many seconds later: a worker blocked in a collective runs its SIGTERM handler only
# when the collective returns, and a stopped (SIGSTOP) one never does. A Ctrl-C does not go
# through this wait (workers stop on their own and return: gridshard.engine.control). torch 2.11's
# agent cannot be told: it waits its own 30 s.
SHUTDOWN_TIMEOUT_S = 5


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(nproc: int, entry, *args, max_restarts: int = 0,
                 agent_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT") -> dict:
    """Run ``entry(*args)`` on ``nproc`` local workers; returns {rank: return value}.
    ``agent_signals``: the signals the elastic agent handles in this process (forward to the
    workers, wait ``SHUTDOWN_TIMEOUT_S``, kill); the caller handles the others.

    A failing worker makes the agent stop the others (within ``monitor_interval``) and, after
    ``max_restarts`` restarts of the whole group, raise
    ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` carrying each
    failed rank's exit code or signal and traceback.
    """
    import torch
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # failures reach the user as gridshard's own one-line message (cli.failure_message), not as
    # the agent's log of each worker's exit
    # (elastic sets a level on each module's logger, so each is quietened by name)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torch ≥ 2.12 takes the agent's shutdown wait; 2.11's LaunchConfig has no such field (its agent waits 30 s)
    wait = {"shutdown_timeout": SHUTDOWN_TIMEOUT_S} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"gridshard-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          start_method="spawn", monitor_interval=0.1, signals_to_handle=agent_signals, **wait)
    return elastic_launch(config, _worker_main)(os.getpid(), entry, *args)


def _worker_main(launcher_pid: int, entry, *args):
    """Every worker of :func:`launch_local`: die with the launcher (``launcher_pid``, this
    worker's parent), then run ``entry(*args)``."""
    from .parent_death import die_with_parent

    die_with_parent(launcher_pid)
    return entry(*args)
