"""The test harness's pool of worker groups (:mod:`gridshard.testing.multiprocess`): it keeps at most
``MAX_LIVE_WORKERS`` live workers, so a wide run that touches every world size stays in memory."""
import os

from gridshard.testing import run_on_ranks


def _my_pid():
    return os.getpid()


def test_worker_groups_beyond_the_live_budget_close_the_least_recently_used(monkeypatch):
    """The pool keeps at most ``MAX_LIVE_WORKERS`` workers: starting a group that would exceed it
    closes the least recently used groups first (their processes exit), a group used again is
    kept."""
    from gridshard.testing import multiprocess as mp_pool

    monkeypatch.setattr(mp_pool, "MAX_LIVE_WORKERS", 5)
    monkeypatch.setattr(mp_pool, "_GROUPS", {})
    try:
        one = run_on_ranks(1, _my_pid)
        run_on_ranks(2, _my_pid)
        assert run_on_ranks(1, _my_pid) == one            # 1 + 2 ≤ 5: both kept, 1 now the most recent
        old_two = mp_pool._GROUPS[2]
        run_on_ranks(3, _my_pid)                          # 1 + 2 + 3 > 5: the 2-group (least recent) goes
        assert sorted(mp_pool._GROUPS) == [1, 3] and not any(p.is_alive() for p in old_two.procs)
        assert run_on_ranks(1, _my_pid) == one
    finally:
        mp_pool.shutdown_all()


def test_a_group_holding_too_many_threads_is_replaced_before_the_next_call(monkeypatch):
    """Workers report their thread count after each call; a group above ``MAX_WORKER_THREADS`` is
    replaced by fresh processes before its next call (never under a call)."""
    from gridshard.testing import multiprocess as mp_pool

    monkeypatch.setattr(mp_pool, "_GROUPS", {})
    try:
        first = run_on_ranks(1, _my_pid)
        assert mp_pool._GROUPS[1].threads >= 1
        assert run_on_ranks(1, _my_pid) == first              # under the bound: the same process
        monkeypatch.setattr(mp_pool, "MAX_WORKER_THREADS", 0)
        assert run_on_ranks(1, _my_pid) != first              # over it: replaced before this call
    finally:
        mp_pool.shutdown_all()


def _gc_facts():
    import gc
    import sys

    return gc.get_freeze_count(), len(gc.get_objects()), "torch" in sys.modules and "gridshard.engine" in sys.modules


class _Cycle:
    def __init__(self):
        self.me = self


def _leave_a_cycle_of(n: int):
    for _ in range(n):
        _Cycle()
    return None


def test_workers_come_with_their_imports_and_collect_only_what_a_call_made():
    """Workers are forked from a server that imported torch and gridshard.engine; they freeze what
    they hold after start-up and after each call's collection, so the next collection scans only the
    next call's objects (a full collection over torch's ~300,000 objects took 170 ms a rank, 1.4 s a
    16-rank call on 2 cores). A call's cyclic garbage is still collected before the freeze."""
    run_on_ranks(2, _leave_a_cycle_of, 20_000)
    for frozen, young, imported in run_on_ranks(2, _gc_facts):
        assert imported                                  # preloaded by the fork server
        assert frozen > 100_000, frozen                  # torch's objects: out of every collection
        assert young < 20_000, young                     # the last call's 20,000 cycles were collected


def _env(name):
    return os.environ.get(name)


def test_a_new_group_sees_the_environment_of_the_moment_it_starts(monkeypatch):
    """Workers are forked from a server started earlier in the session: they take the parent's
    environment of their own start, as spawned processes did (a variable set since reaches them)."""
    monkeypatch.setenv("GRIDSHARD_POOL_MARK", "set after the fork server started")
    assert run_on_ranks(2, _env, "GRIDSHARD_POOL_MARK", fresh=True) == ["set after the fork server started"] * 2
