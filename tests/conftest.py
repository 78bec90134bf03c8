"""Shared fixtures. Multi-rank tests call ``gridshard.testing.run_on_ranks(n, body, ...)``
with a module-level ``body``; worker groups are reused across the whole session."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _stop_workers_at_end():
    yield
    from gridshard.testing import shutdown_all

    shutdown_all()
