"""The multi-process harness itself: errors name the rank, deadlocks fail fast with stacks."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from gridshard.testing import RankFailure, run_on_ranks


def _rank():
    return dist.get_rank()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return 0


def _deadlock():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return 0


def _raise_then_wait():
    if dist.get_rank() == 1:
        raise ValueError("boom before the collective")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1, which has failed
    return 0


def _pid():
    return os.getpid()


def test_returns_per_rank_results_and_reuses_workers():
    """Reuse is checked by process id, not by a time limit (which a busy machine could break)."""
    assert run_on_ranks(2, _rank) == [0, 1]
    first = run_on_ranks(2, _pid)
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_on_ranks(2, _pid) == first, "a second call must run in the same worker processes"


def test_exception_names_the_rank_and_traceback():
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _raise_on_rank_one)
    assert "rank(s) [1]" in str(e.value) and "boom on one" in str(e.value)
    assert run_on_ranks(2, _rank) == [0, 1]  # the group is rebuilt


def test_deadlock_fails_fast_with_stack_of_stuck_rank():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _deadlock, timeout=8)
    # the harness's own 8 s timeout must end it, not gloo's (300 s, set in the workers): the
    # message says so; the bound, far below 300 s but far above 8 s + 1 s of stack dumping,
    # only catches a hang and leaves a busy machine plenty of slack
    assert time.monotonic() - t0 < 120
    msg = str(e.value)
    assert "timeout during _deadlock" in msg and "stack of rank 0" in msg and "_deadlock" in msg


def test_timeout_after_a_failure_keeps_the_traceback():
    """One rank raises, the other waits for it in a collective: the failure reports both the
    traceback of the rank that raised and the stack of the one that waits (the grace period
    ends the call, not the 60 s timeout)."""
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _raise_then_wait, timeout=60, grace_s=2)
    msg = str(e.value)
    assert "timeout during _raise_then_wait" in msg and "rank(s) [1] had failed before" in msg, msg
    assert "--- traceback of rank 1 ---" in msg and "boom before the collective" in msg, msg
    assert "--- stack of rank 0 ---" in msg and "_raise_then_wait" in msg.split("--- stack of rank 0 ---")[1], msg


def _returns_a_lambda():
    return lambda: 0


def _echo(x):
    return x


def test_unpicklable_result_or_argument_fails_at_once_with_the_cause():
    """A result the worker cannot send back, or an argument the parent cannot send, is a
    plain error naming the pickling problem, not a silent wait for the timeout."""
    # the proof is the message (a pickling error, no "timeout"); the time bound only adds that
    # nobody waited for the 180 s call timeout: half of it, ~50× what the two calls take
    # (one error plus one worker restart, ~2 s), so a busy machine does not make it flaky
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _returns_a_lambda, timeout=180)
    assert "pickle" in str(e.value) and "timeout" not in str(e.value)
    with pytest.raises(TypeError, match="pickle"):
        run_on_ranks(2, _echo, lambda: 0, timeout=180)
    assert time.monotonic() - t0 < 90
    assert run_on_ranks(2, _echo, 5) == [5, 5]
