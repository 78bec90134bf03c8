"""Which collective backend and which device a rank uses: decided here, once, for the mesh, the
job (trainer), :func:`gridshard.parallelize` and the CLI's checks before launch.

``parallel.backend`` (``auto | nccl | gloo``) and the machine decide::

    auto : nccl when CUDA is available, else gloo
    nccl : needs CUDA; rank with local rank r computes on cuda:r            (r < visible GPUs)
    gloo : computes on the CPU, also on a CUDA host

Why gloo means CPU: gloo's CUDA support is partial (no reduce-scatter on CUDA tensors, every
collective staged through host memory), so a gloo job on GPUs would be slow and fail in
ZeRO-2/3 and sequence parallelism; and with several ranks the old ``LOCAL_RANK % device_count``
mapping put two ranks on one GPU. A gloo run on a GPU host is a CPU run (tests, checks).

Once a process group exists, its backend is the truth: :func:`rank_device` reads
``dist.get_backend()``, so a job built inside the test harness's gloo group computes on the CPU
whatever the machine has.

An nccl rank per GPU, never more: two nccl ranks on one GPU fail inside NCCL ("duplicate GPU").
:func:`check_ranks_per_node` refuses that before any worker starts.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from .errors import ConfigError

BACKENDS = ("auto", "nccl", "gloo")


def resolve_backend(requested: str = "auto") -> str:
    """``nccl`` or ``gloo`` for ``parallel.backend`` = ``requested`` on this machine.

    ``auto`` → nccl iff ``torch.cuda.is_available()``. ``nccl`` without CUDA is a ConfigError
    (``gloo`` is always possible)."""
    if requested not in BACKENDS:
        raise ConfigError(f"parallel.backend={requested!r} is invalid: it must be one of {', '.join(BACKENDS)}. "
                          f"Fix: parallel.backend: auto.")
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend=nccl needs CUDA GPUs and none is visible. "
                          "Fix: parallel.backend: gloo (or auto).")
    return requested


def device_for_backend(backend: str, local_rank: Optional[int] = None) -> torch.device:
    """The device of the rank with local rank ``local_rank`` (default ``$LOCAL_RANK``, 0) under
    ``backend``: ``cuda:local_rank`` for nccl, the CPU for gloo (module docstring)."""
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        raise ConfigError(f"local rank {local_rank} has no GPU of its own: {gpus} visible, and nccl needs one GPU "
                          f"per rank. Fix: parallel.backend: gloo, or start at most {gpus} processes per node.")
    return torch.device("cuda", local_rank)


def rank_device(requested: str = "auto") -> torch.device:
    """This rank's device: from the process group's backend when one exists, else from
    ``parallel.backend`` = ``requested`` on this machine."""
    return device_for_backend(dist.get_backend() if dist.is_initialized() else resolve_backend(requested))


def check_ranks_per_node(ranks_per_node: int, requested: str = "auto", flag: str = "--nproc") -> None:
    """Refuse more nccl ranks on one node than visible GPUs (ConfigError, exit 2 in the CLI).

    ``flag``: how the user set the count (``--nproc``, ``--nproc-per-node``)."""
    if resolve_backend(requested) != "nccl":
        return
    gpus = torch.cuda.device_count()
    if ranks_per_node > gpus:
        raise ConfigError(f"{flag} {ranks_per_node} starts {ranks_per_node} nccl ranks on this node but it has "
                          f"{gpus} visible GPU(s): nccl needs one GPU per rank. Fix: parallel.backend: gloo "
                          f"(a CPU run, for checks and tests), or {flag} {gpus} or fewer.")


def batch_to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` (a host tensor of token ids) on ``device``. Host → CUDA: pinned first
    (``pin_memory()``, a host copy of b·s·8 bytes), then copied ``non_blocking``, so the upload
    really is asynchronous (from pageable memory CUDA stages the copy and the host waits).
    Anything else (CPU → CPU, already on the device): ``.to(device)`` unchanged."""
    device = torch.device(device)
    if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
