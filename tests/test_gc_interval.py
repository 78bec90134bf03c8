"""``train.gc_interval`` (gridshard/engine/gc_control.py): automatic garbage collection off during the
run, a collection on every rank after every k-th step, the collector's state given back when the run
ends (normally or not), and the same losses as Python's automatic collection."""
import gc

import pytest

from gridshard.config import resolve_config
from gridshard.engine.gc_control import StepCollector
from gridshard.errors import ConfigError
from gridshard.testing import run_on_ranks

CFG = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
       "parallel": {"data": 2},
       "train": {"global_batch": 4, "micro_batch": 1, "steps": 5, "log_interval": 1, "lr": 1e-3}}


def _with(**train):
    return {**CFG, "train": {**CFG["train"], **train}}


def test_the_collector_is_off_between_collections_and_given_back(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    was = gc.isenabled()
    gc.enable()
    try:
        c = StepCollector(3)
        assert not c.due(3)                            # not started: nothing is due
        c.start()
        assert not gc.isenabled() and calls == [2]    # off, after one full collection
        assert [s for s in range(1, 10) if c.due(s)] == [3, 6, 9]
        c.collect()
        assert calls == [2, 1]                        # after steps: generations 0 and 1
        c.stop()
        assert gc.isenabled()
        gc.disable()                                    # off before the run: it stays off
        c.start()
        c.stop()
        assert not gc.isenabled()
        gc.enable()
        StepCollector(0).start()                        # 0: Python's own collection, untouched
        assert gc.isenabled() and calls == [2, 1, 2]
    finally:
        (gc.enable if was else gc.disable)()


def _run(cfg, fail_at=None):
    """This rank's losses, the steps after which the trainer collected, whether automatic collection was
    on during each step, and after the run."""
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    collected, during = [], []
    collect, step = trainer.collector.collect, trainer.step

    def counted():
        collected.append(trainer.ranges.step)
        return collect()

    def watched(k):
        during.append(gc.isenabled())
        if k + 1 == fail_at:
            raise RuntimeError("planted")
        return step(k)
    trainer.collector.collect, trainer.step = counted, watched
    try:
        losses = trainer.run()
    except RuntimeError as e:
        losses = str(e)
    return losses, collected, during, gc.isenabled()


def test_ranks_collect_at_the_same_steps_and_train_as_with_automatic_collection():
    every2 = run_on_ranks(2, _run, _with(gc_interval=2))
    auto = run_on_ranks(2, _run, _with(gc_interval=0))
    for losses, collected, during, after in every2:
        assert collected == [2, 4] and during == [False] * 5 and after
        assert losses == auto[0][0]                      # the collector never changes a value
    for losses, collected, during, after in auto:
        assert collected == [] and during == [True] * 5 and after
    failed = run_on_ranks(2, _run, _with(gc_interval=2), fail_at=3)
    assert all(r[0] == "planted" and r[3] for r in failed), failed   # back on after a failed run


def test_a_negative_interval_is_refused_with_its_fix():
    with pytest.raises(ConfigError, match=r"train.gc_interval=-1 is invalid: it must be >= 0. Fix: set train.gc_interval to 0"):
        resolve_config(_with(gc_interval=-1), world_size=2)


def test_a_trainer_dropped_before_a_run_is_freed_when_the_run_starts():
    """A model and its gradient reduction refer to each other: a dropped trainer waits for a full
    collection. The run's start makes one, so the first step runs without the dropped trainer's
    parameters and optimizer states (with automatic collection off, they were kept to the run's end)."""
    import weakref

    from gridshard.engine import Trainer

    cfg = {**CFG, "parallel": {"data": 1}, "train": {**CFG["train"], "steps": 2}}
    was = gc.isenabled()
    gc.disable()                              # no automatic collection may free it first
    try:
        dropped = Trainer(cfg, progress=False)
        dropped.run()
        gone = weakref.ref(next(dropped.model.parameters()))
        del dropped
        assert gone() is not None             # in a reference cycle: not freed by its reference count
        trainer = Trainer(cfg, progress=False)
        step, seen = trainer.step, []
        trainer.step = lambda k: seen.append(gone() is None) or step(k)
        trainer.run()
        assert seen == [True, True]
    finally:
        (gc.enable if was else gc.disable)()
