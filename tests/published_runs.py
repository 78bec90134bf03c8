"""``benchmarks/planner_published.py`` as a module, for the tests that check the planner against
published runs (its layouts, sources and FLOP counts are defined there once)."""
import importlib.util
import pathlib
import sys


def published_runs():
    """The benchmark module, loaded once per session."""
    if "planner_published" in sys.modules:
        return sys.modules["planner_published"]
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "planner_published.py"
    spec = importlib.util.spec_from_file_location("planner_published", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["planner_published"] = module                 # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
