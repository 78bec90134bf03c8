"""Shared fixtures. Multi-rank tests call ``gridshard.testing.run_on_ranks(n, body, ...)``
with a module-level ``body``; worker groups are reused across the whole session."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _imports_frozen():
    """torch's and gridshard's objects out of this process's collections: a training run starts with
    a full one (gridshard.engine.gc_control), which would walk them at every in-process run (~170 ms);
    the workers do the same (gridshard.testing.multiprocess)."""
    import gc

    import gridshard.engine  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _stop_workers_at_end():
    yield
    from gridshard.testing import shutdown_all

    shutdown_all()


@pytest.fixture
def no_launch(monkeypatch):
    """The CLI's local launcher raises if called, and no torchrun variables are set: a command
    that must refuse before any worker starts fails loudly if it starts one."""
    import gridshard.launch

    def boom(*a, **k):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(gridshard.launch, "launch_local", boom)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
