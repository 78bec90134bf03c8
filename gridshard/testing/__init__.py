"""Test helpers: a pool of reusable gloo worker groups and reference comparisons."""
from .multiprocess import RankFailure, WorkerGroup, run_on_ranks, shutdown_all
from .compare import assert_close

__all__ = ["RankFailure", "WorkerGroup", "run_on_ranks", "shutdown_all", "assert_close"]
