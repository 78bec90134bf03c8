"""The multi-process harness itself: errors name the rank, deadlocks fail fast with stacks."""
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


def test_returns_per_rank_results_and_reuses_workers():
    assert run_on_ranks(2, _rank) == [0, 1]
    t0 = time.monotonic()
    assert run_on_ranks(2, _rank) == [0, 1]
    assert time.monotonic() - t0 < 5


def test_exception_names_the_rank_and_traceback():
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _raise_on_rank_one)
    assert "rank(s) [1]" in str(e.value) and "boom on one" in str(e.value)
    assert run_on_ranks(2, _rank) == [0, 1]  # the group is rebuilt


def test_deadlock_fails_fast_with_stack_of_stuck_rank():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _deadlock, timeout=8)
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "timeout" in msg and "stack of rank 0" in msg and "_deadlock" in msg


def _returns_a_lambda():
    return lambda: 0


def _echo(x):
    return x


def test_unpicklable_result_or_argument_fails_at_once_with_the_cause():
    """A result the worker cannot send back, or an argument the parent cannot send, is a
    plain error naming the pickling problem, not a silent wait for the timeout."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(2, _returns_a_lambda, timeout=60)
    assert "pickle" in str(e.value) and "timeout" not in str(e.value)
    with pytest.raises(TypeError, match="pickle"):
        run_on_ranks(2, _echo, lambda: 0, timeout=60)
    assert time.monotonic() - t0 < 30
    assert run_on_ranks(2, _echo, 5) == [5, 5]
