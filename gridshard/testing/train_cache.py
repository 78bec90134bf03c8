"""Training runs for tests: a body run on the ranks its config's layout needs, optionally once per
config per process.

A test module passes its own module-level ``body(cfg, *args)`` (it builds the ``Trainer``; this module
imports no engine code): :func:`train_on_ranks` runs it every time; a :class:`TrainCache` made at the
module's top level runs it the first time it sees a config and hands the same result to every later
test that asks for an equal config (the cache lives in that instance, so in the test module).
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional, Union

from .multiprocess import run_on_ranks

AXES = ("data", "pipeline", "context", "tensor")


def world_size(cfg: dict) -> int:
    """The ranks ``cfg``'s layout needs: the product of ``parallel.data``, ``pipeline``, ``context`` and
    ``tensor`` (an axis the config leaves out counts 1; ``tensor`` already holds 2.5D's depth)."""
    parallel = cfg.get("parallel", {})
    return math.prod(int(parallel.get(axis, 1)) for axis in AXES)


def train_on_ranks(body: Callable, cfg: dict, *args, agree: Optional[Union[int, str]] = None,
                   what: str = "the loss/grad-norm history", timeout: float = 300) -> list:
    """Run ``body(cfg, *args)`` on :func:`world_size` (cfg) ranks and return the per-rank results.

    ``agree``: assert every rank's result agrees with rank 0's: its first ``agree`` items (an int),
    all of it (``"all"``), or nothing (None); the message names the layout and ``what`` is compared."""
    per_rank = run_on_ranks(world_size(cfg), body, cfg, *args, timeout=timeout)
    if agree is not None:
        cut = (lambda r: r) if agree == "all" else (lambda r: r[:agree])
        for other in per_rank[1:]:
            assert cut(other) == cut(per_rank[0]), f"{cfg.get('parallel')}: ranks disagree on {what}"
    return per_rank


class TrainCache:
    """``run = TrainCache(body, ...)`` at a test module's top level; ``run(cfg, *args)`` is
    :func:`train_on_ranks` (body, cfg, *args) the first time a config equal to ``cfg`` (as sorted JSON)
    is asked for, and that run's result afterwards, so several tests share one run.

    ``args`` (a run directory, say) are not part of the key: a later call with the same config and
    another directory returns the stored result and writes nothing there. ``bind``: arguments every
    call passes right after ``cfg`` (``body(cfg, *bind, *args)``; module-level functions such as a
    test module's ``facts(trainer)``, pickled by reference). ``combine`` turns the per-rank list into
    the stored result (default: rank 0's); ``agree``, ``what`` and ``timeout`` go to
    :func:`train_on_ranks`."""

    def __init__(self, body: Callable, *, bind: tuple = (), agree: Optional[Union[int, str]] = None,
                 what: str = "the loss/grad-norm history", combine: Optional[Callable[[list], Any]] = None,
                 timeout: float = 300):
        self.body, self.bind, self.agree, self.what, self.timeout = body, tuple(bind), agree, what, timeout
        self.combine = combine or (lambda per_rank: per_rank[0])
        self._results: dict = {}

    def __call__(self, cfg: dict, *args):
        key = json.dumps(cfg, sort_keys=True)
        if key not in self._results:
            per_rank = train_on_ranks(self.body, cfg, *self.bind, *args, agree=self.agree, what=self.what,
                                      timeout=self.timeout)
            self._results[key] = self.combine(per_rank)
        return self._results[key]
