"""Deterministic fault injection for crash-safety tests: die at a named point of a run.

``GRIDSHARD_FAULT="POINT:RANK[:STEP]"`` makes global rank RANK kill itself (SIGKILL, no
cleanup, exactly like an OOM kill) when it reaches POINT (at optimizer step STEP, if
given). It fires only in the first attempt of an elastic job
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job runs clean. Points:

==========================  ===============================================================
``step``                    after optimizer step STEP
``save_start``              a save began; nothing of it is on disk
``save_after_data``         this rank's chunks are on disk; DCP's ``.metadata`` is not
``save_after_metadata``     rank 0: all chunks and ``.metadata`` written; no meta.json/manifest
``save_after_manifest``     rank 0: meta.json and manifest written; folder still ``.partial``
``save_after_rename``       rank 0: folder renamed to ``step_N``; ``latest`` not updated
``save_after_latest``       rank 0: ``latest`` updated; older checkpoints not yet pruned
==========================  ===============================================================

Tests inside one process use :class:`FaultPlan` with ``action="raise"``: the save stops
where a kill would have stopped it (:class:`InjectedFault`), leaving the same files behind;
with ``errno`` set (e.g. ``errno.ENOSPC``) it raises that ``OSError`` instead, as a full or
read-only disk would.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

POINTS = ("step", "save_start", "save_after_data", "save_after_metadata", "save_after_manifest",
          "save_after_rename", "save_after_latest")


class InjectedFault(RuntimeError):
    """Raised instead of a kill by a ``FaultPlan(action="raise")``."""


@dataclass(frozen=True)
class FaultPlan:
    point: str
    rank: Optional[int]                  # None: every rank
    step: Optional[int] = None
    action: str = "kill"
    errno: Optional[int] = None          # action="raise": raise OSError(errno) instead of InjectedFault

    @staticmethod
    def from_env(env=os.environ) -> Optional["FaultPlan"]:
        spec = env.get("GRIDSHARD_FAULT")
        if not spec or env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
            return None
        parts = spec.split(":")
        if parts[0] not in POINTS or len(parts) not in (2, 3):
            raise ValueError(f"GRIDSHARD_FAULT={spec!r}: expected POINT:RANK[:STEP] with POINT in {POINTS}")
        return FaultPlan(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None)

    def hit(self, point: str, rank: int, step: Optional[int] = None) -> None:
        if point != self.point or (self.rank is not None and rank != self.rank) or \
                (self.step is not None and step != self.step):
            return
        if self.action == "raise" and self.errno is not None:
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected at {point} on rank {rank}, step {step})")
        if self.action == "raise":
            raise InjectedFault(f"injected fault at {point} on rank {rank} (step {step})")
        os.kill(os.getpid(), signal.SIGKILL)


def hit(plan: Optional[FaultPlan], point: str, rank: int, step: Optional[int] = None) -> None:
    if plan is not None:
        plan.hit(point, rank, step)
