"""gridshard's saved-tensor pack hooks keep no graph alive (:mod:`gridshard.nn.saved`).

A hook that returns the tensor itself makes a node's saved output refer back to the node; the
graph then outlives every reference to it when no backward runs through it (zero bubble's
input-only nodes, a forward whose backward never comes). Each hook site: the output of an
``exp`` made under it is freed once the caller drops it, and the gradients are unchanged."""
import gc
import types
import weakref

import pytest
import torch

from gridshard.engine.memory_meter import SavedTensorMeter
from gridshard.nn.rebuild import RebuildRegion
from gridshard.pipeline.meter import StageMeter


def _stage_meter_hooks():
    """The pipeline meter's forward wrapper, around a stand-in stage."""
    meter = StageMeter(None, [])
    stage = types.SimpleNamespace(stage_index=0, forward_one_chunk=lambda chunk, fn: fn(),
                                  backward_one_chunk=None, backward_weight_one_chunk=None,
                                  get_fwd_send_ops=None, get_bwd_send_ops=None)
    meter.attach(stage)
    return lambda fn: stage.forward_one_chunk(0, fn)


def _saved_tensor_meter(fn):
    with SavedTensorMeter():
        return fn()


def _rebuild_region(fn):
    region = RebuildRegion()
    region.open()
    try:
        return fn()
    finally:
        region.close()


SITES = {"pipeline-meter": _stage_meter_hooks, "saved-tensor-meter": lambda: _saved_tensor_meter,
         "rebuild-region": lambda: _rebuild_region}


@pytest.mark.parametrize("site", SITES)
def test_a_dropped_graph_is_freed_and_gradients_are_unchanged(site):
    run = SITES[site]()
    x = torch.randn(64, requires_grad=True)
    y = run(lambda: x.exp())                       # exp saves its own output
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None, f"{site}: a graph no backward ran through is kept alive by its saved output"

    w = torch.randn(64, 64, requires_grad=True)
    run(lambda: (x.exp() @ w).tanh().sum()).backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    (x.exp() @ w).tanh().sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad), site
