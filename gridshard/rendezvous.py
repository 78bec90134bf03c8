"""Joining the world with a message that names who is missing.

``init_process_group`` waits for all ``WORLD_SIZE`` ranks and, when one never comes, ends with
"Timed out after N seconds waiting for clients. 3/4 clients joined": neither which rank is
missing nor what each rank was told. The source documents name this as the first hang to
check (a WORLD_SIZE/RANK mismatch at start-up). :func:`join` runs before the group is created,
on the same key-value store:

1. the store: the elastic agent's under torchrun (one prefix per attempt,
   :func:`gridshard.mesh.elastic_attempt_store`), else a TCP store that rank 0 hosts at
   ``MASTER_ADDR:MASTER_PORT`` (what ``init_process_group``'s ``env://`` builds; gridshard builds
   it so the same store answers both steps);
2. every rank claims its ``RANK`` (a counter: a rank claimed twice is named) and publishes the
   environment it saw (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, host, pid);
3. it waits for ranks 0 … WORLD_SIZE − 1, up to the timeout (``train.collective_timeout_s``);
   then it raises :class:`RendezvousError` naming the expected world size, the ranks that
   arrived with their environments, and the missing ranks; or, when all arrived, checks that
   they agree on ``WORLD_SIZE``.

A rank that cannot reach rank 0's store at all (rank 0 not started, or other ``MASTER_*``
values) says so, with its own environment. Cost: a few store round trips at start-up.

On NCCL, :func:`keep_flight_recorder` (before the group is created) has torch's flight recorder
keep the last collectives of each rank and dump them into ``RUN_DIR/flight_recorder/rank_R`` when
a collective times out (torch's ``TORCH_FR_*`` / ``TORCH_NCCL_*`` variables; a user's own settings
win). Read a dump with torch's ``torchfrtrace``; gloo keeps no such record, and
:mod:`gridshard.engine.hang` names a timed-out collective on every backend.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time

import torch.distributed as dist

from .errors import GridshardError

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_PREFIX = "gridshard/rendezvous"
#: how long rank 0, the store's host, keeps it up after a failed rendezvous for the others to read it
REPORT_S = 5.0


class RendezvousError(GridshardError, RuntimeError):
    """The world could not be joined; the message names the missing ranks and what each rank saw."""


def seen_environment() -> dict:
    """The launch environment of this process (module docstring, step 2)."""
    return {**{k: os.environ.get(k) for k in ENV_KEYS}, "host": socket.gethostname(), "pid": os.getpid()}


def describe(env: dict) -> str:
    return " ".join(f"{k}={env.get(k)}" for k in (*ENV_KEYS, "host", "pid") if env.get(k) is not None)


def rank0_store(timeout_s: float):
    """The TCP store rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``; the other ranks connect to it.
    Raises :class:`RendezvousError` when it cannot be reached within ``timeout_s``."""
    addr, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    try:
        return dist.TCPStore(addr, port, None, rank == 0, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, TimeoutError, OSError) as e:
        where = f"{addr}:{port}"
        if rank == 0:
            raise RendezvousError(f"rendezvous: rank 0 could not host the store at {where}: {e}. Fix: choose a free "
                                  f"MASTER_PORT on this host ({describe(seen_environment())}).") from None
        raise RendezvousError(
            f"rendezvous: rank {rank} could not reach rank 0's store at {where} in {timeout_s:g} s "
            f"(train.collective_timeout_s): rank 0 has not started, or it was given another MASTER_ADDR/MASTER_PORT. "
            f"This rank saw: {describe(seen_environment())}. Fix: start rank 0 with the same MASTER_ADDR and "
            f"MASTER_PORT (and WORLD_SIZE), or check that {where} is reachable from {socket.gethostname()}.") from None


def join(store, rank: int, world: int, timeout_s: float) -> None:
    """Steps 2–3 of the module docstring on ``store``: returns once all ``world`` ranks arrived and
    agree on the world size, else raises :class:`RendezvousError`."""
    store.add(f"{_PREFIX}/claims/{rank}", 1)
    store.set(f"{_PREFIX}/env/{rank}", json.dumps(seen_environment()))
    keys = [f"{_PREFIX}/env/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError):
        raise RendezvousError(_incomplete(store, rank, world, keys, timeout_s)) from None
    seen = {r: _read(store.get(keys[r])) for r in range(world)}
    disagree = {r: e for r, e in seen.items() if str(e.get("WORLD_SIZE")) != str(world)}
    if disagree:
        raise RendezvousError(
            f"rendezvous: the ranks disagree on WORLD_SIZE: rank {rank} saw {world}, "
            + "; ".join(f"rank {r} saw {e.get('WORLD_SIZE')} ({describe(e)})" for r, e in sorted(disagree.items()))
            + ". Fix: give every rank the same WORLD_SIZE (torchrun sets it from --nnodes × --nproc-per-node).")


def _incomplete(store, rank: int, world: int, keys: list, timeout_s: float) -> str:
    """The message of a rendezvous that timed out. Rank 0 hosts the store: it waits (up to
    ``REPORT_S``) until every arrived rank has read what it needs, so that none finds it gone."""
    try:
        arrived = [r for r in range(world) if store.check([keys[r]])]
        seen = {r: _read(store.get(keys[r])) for r in arrived}
        twice = [r for r in arrived if store.add(f"{_PREFIX}/claims/{r}", 0) > 1]
        done = store.add(f"{_PREFIX}/reported", 1)
        deadline = time.monotonic() + REPORT_S
        while rank == 0 and done < len(arrived) and time.monotonic() < deadline:
            time.sleep(0.1)
            done = store.add(f"{_PREFIX}/reported", 0)
    except (RuntimeError, OSError):                       # rank 0 (the store's host) is gone already
        return (f"rendezvous incomplete after {timeout_s:g} s (train.collective_timeout_s), seen from rank {rank} "
                f"({describe(seen_environment())}): WORLD_SIZE={world} ranks expected, and rank 0's store closed "
                f"before the missing ranks could be read; rank 0's message names them.")
    missing = [r for r in range(world) if r not in arrived]
    lines = [f"rendezvous incomplete after {timeout_s:g} s (train.collective_timeout_s), seen from rank {rank}: "
             f"WORLD_SIZE={world} ranks expected, {len(arrived)} arrived; missing: "
             f"rank{'s' if len(missing) > 1 else ''} {', '.join(str(r) for r in missing)}."]
    if twice:
        lines.append(f"RANK {', '.join(str(r) for r in twice)} was claimed by more than one process (each rank "
                     f"needs its own RANK).")
    lines.append("Each arrived rank saw: " + "; ".join(f"rank {r}: {describe(seen[r])}" for r in arrived) + ".")
    lines.append(f"Fix: start the missing rank{'s' if len(missing) > 1 else ''} with the same MASTER_ADDR, "
                 f"MASTER_PORT and WORLD_SIZE, or set WORLD_SIZE to the processes you start (torchrun: "
                 f"--nnodes × --nproc-per-node).")
    return " ".join(lines)


def keep_flight_recorder(run_dir: str) -> str:
    """Have NCCL's flight recorder dump into ``RUN_DIR/flight_recorder/`` on a timeout (module
    docstring); returns the folder. Sets environment variables the NCCL process group reads when
    it is created, unless the user set them."""
    folder = os.path.join(run_dir, "flight_recorder")
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, "rank_")
    for name, value in (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_FR_DUMP_TEMP_FILE", prefix),
                        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)):
        os.environ.setdefault(name, value)
    return folder


def _read(raw: bytes) -> dict:
    """A rank's published environment, checked before use (bytes from another process are data)."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
