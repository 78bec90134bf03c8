"""Where each rank's time goes, always on: compute, collectives, data loading, and who waits for whom.

Every rank accumulates, over a log interval of n steps and W wall seconds (the same interval on
every rank: the step's collectives keep the ranks in step):

* ``comm_s``: seconds inside the collectives the ledger records (:mod:`gridshard.comm.ledger`,
  timed where ``train.time_comm`` is on, the default on CPU): the transfer, and the wait for the
  slowest member of each group;
* ``data_s``: seconds producing the step's batches (``Job.batch``);
* ``compute_s`` = W − comm − data: everything else (forward and backward math, optimizer, Python).

The interval's figures are all-gathered once per log step, with the statistics the trainer
gathers anyway (one all-gather, :meth:`gridshard.engine.trainer.Trainer._gather_rank_stats`),
and turned into per-step seconds. What one collective costs is the same on every member, so
the rank that spends the least time in collectives waited least; the rest of everyone's
collective time is waiting::

    wait_r = comm_r − min_r' comm_r'          rank_wait_max = max_r wait_r   (seconds per step)

A rank the others wait for is a **straggler**: the rank with the most compute time, named when it
exceeds the median compute time of the other ranks by more than ``STRAGGLER_SHARE`` of the step
and by more than ``STRAGGLER_MIN_S``, over an interval of at least ``STRAGGLER_MIN_STEPS`` steps
(what it does beyond them, they spend waiting for it in the collectives). Compute, not the least
wait, names it: a rank held up inside a collective (descheduled, or paused) counts that time as
collective time, so its own collective time is no floor. One such rank gets one warning line, with the likely causes (a slow or
throttled device, another job on its cores, a slow data source, a tensor group that spans
nodes). With ``time_comm`` off (the default on CUDA) the collective times are unknown: the fields
are null. Pipeline stages wait for each other by design (``bubble_share``); the schedule's sends
are not collectives and count as compute here.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import List, Optional

#: how far the slowest rank's compute time exceeds the others' median, as a share of the step, for it to be named
#: (unloaded 4-rank runs here: at most 13 % and 12 ms; a rank stopped 80 % of the time: 22-30 % at T = 4, where two
#: thirds of its stops land inside the tensor collectives and count as everyone's collective time)
STRAGGLER_SHARE = 0.15
#: and at least this many seconds per step, over a log interval of at least this many steps: on a few shared
#: CPU cores, one-step intervals and millisecond steps differ by a quarter between ranks with no straggler
STRAGGLER_MIN_S, STRAGGLER_MIN_STEPS = 0.02, 3


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per step over a log interval (module docstring)."""

    rank: int
    compute_s: float
    comm_s: float
    data_s: float
    wait_s: float = 0.0

    def row(self) -> dict:
        return {"rank": self.rank, "compute_s": self.compute_s, "comm_s": self.comm_s, "wait_s": self.wait_s,
                "data_s": self.data_s}


@dataclass(frozen=True)
class StragglerVerdict:
    """The interval's per-rank table, the longest wait and the straggler (None when no rank is)."""

    ranks: List[RankTimes]
    step_s: float
    rank_wait_max: float
    straggler_rank: Optional[int]

    def warning(self, step: int) -> str:
        """The one line naming the straggler (module docstring)."""
        r = self.straggler_rank
        others = statistics.median(t.compute_s for t in self.ranks if t.rank != r)
        extra = self.ranks[r].compute_s - others
        return (f"step {step}: rank {r} is a straggler: it computes {extra:.3f} s per step longer than the median "
                f"rank ({extra / self.step_s:.0%} of the {self.step_s:.3f} s step), which the others spend waiting "
                f"for it in collectives (the longest wait {self.rank_wait_max:.3f} s per step; its data loading "
                f"{self.ranks[r].data_s:.3f} s). Likely "
                f"causes: a slower or throttled device, other work on its cores, a slow data source on its host, a "
                f"group that spans nodes. RUN_DIR/ranks.jsonl has the per-rank table.")


def straggler_verdict(step_s: float, comm_s: List[float], data_s: List[float],
                      n_steps: int = STRAGGLER_MIN_STEPS, warm_up: bool = False) -> StragglerVerdict:
    """The verdict of one interval of ``n_steps`` steps from each rank's seconds per step in
    collectives and in data loading (index = rank) and the step time (module docstring). ``warm_up``:
    the process's first interval, whose first step each rank spends partly in one-time work (lazy
    initialisation, the allocator's first requests, compilation) at its own pace: nobody is named
    from it (``gridshard diagnose`` reads the intervals after it too)."""
    floor = min(comm_s)
    ranks = [RankTimes(r, max(0.0, step_s - c - d), c, d, c - floor) for r, (c, d) in enumerate(zip(comm_s, data_s))]
    longest = max(t.wait_s for t in ranks)
    named = None
    if len(ranks) > 1 and step_s > 0 and n_steps >= STRAGGLER_MIN_STEPS and not warm_up:
        slowest = max(ranks, key=lambda t: t.compute_s)
        others = statistics.median(t.compute_s for t in ranks if t.rank != slowest.rank)
        if slowest.compute_s - others > max(STRAGGLER_SHARE * step_s, STRAGGLER_MIN_S):
            named = slowest.rank
    return StragglerVerdict(ranks, step_s, longest, named)
