"""Every private PyTorch name gridshard calls goes through :mod:`gridshard.torch_private` (issue 39):
each wrapper works on the pinned torch, each falls back (or fails with one clear error) when its
private name is hidden, and no other file of the package names a private ``torch.X._Y``."""
import datetime
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist

from gridshard import torch_private as tp

ROOT = os.path.join(os.path.dirname(__file__), "..", "gridshard")


def test_no_private_torch_name_outside_the_gated_module():
    pattern = re.compile(r"torch\.\w*\._\w|torch\._(?!_)\w|\._flatten\(|_set_pg_timeout|_get_default_store|\._world\b")
    found = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not path.endswith("torch_private.py"):
                with open(path) as f:
                    found += [f"{path}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert found == []


def test_the_wrappers_on_this_torch():
    x = torch.ones(3, requires_grad=True)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(tp.in_backward())
            return g * 2

    assert not tp.in_backward()
    Probe.apply(x).sum().backward()
    assert seen == [True]
    assert tp.outer_saved_hooks() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert tp.outer_saved_hooks() == (pack, unpack)
    tp.assert_async(torch.tensor(True), "never")
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    assert [float(n) for n in tp.foreach_norm(ts)] == [5.0, 1.0]
    tp.foreach_mul_(ts, torch.tensor(2.0))
    assert ts[0].tolist() == [6.0, 8.0]
    assert tp.tree_flatten(([torch.ones(1)], {"a": 2}))[0][1] == 2
    sent = torch.ones(4)
    assert tp.can_count_holders() and tp.only_holders(sent, 1)
    view = sent.view(2, 2)                        # another tensor on the storage
    assert not tp.only_holders(sent, 2)
    del view
    assert tp.only_holders(sent, 1)
    kind = type("Kind", (), {"value": "F"})()
    action = type("Action", (), {"computation_type": kind, "stage_index": 1, "microbatch_index": 3})()
    schedule = type("Runtime", (), {"pipeline_order_with_comms": {0: [action]}, "stage_index_to_group_rank": {1: 0}})()
    assert tp.lowered_pipeline_order(schedule) == ({0: [("F", 1, 3)]}, {1: 0})
    kind.value = "OVERLAP_F_B"                   # a kind the replay does not know
    assert tp.lowered_pipeline_order(schedule) is None


def test_fallbacks_when_a_private_name_is_gone(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(tp.PrivateTorchMissing, match="Fix: install the pinned torch"):
        tp.in_backward()
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    with pytest.raises(tp.PrivateTorchMissing, match="recompute rebuild"):
        tp.outer_saved_hooks()
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    assert tp.will_execute(object()) is False
    for name in ("_assert_async", "_foreach_norm", "_foreach_mul_"):
        monkeypatch.delattr(torch, name)
    tp.assert_async(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="an id"):
        tp.assert_async(torch.tensor(False), "an id")
    ts = [torch.tensor([3.0, 4.0])]
    assert float(tp.foreach_norm(ts)[0]) == 5.0
    tp.foreach_mul_(ts, torch.tensor(0.5))
    assert ts[0].tolist() == [1.5, 2.0]
    with pytest.raises(tp.PrivateTorchMissing, match="DeviceMesh._flatten"):
        tp.flatten_mesh(object(), "tensor")
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.set_group_timeout(datetime.timedelta(seconds=5), None)
    assert "collective_timeout_s" in str(caught[0].message)
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    assert tp.default_store() is None
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    assert tp.live_subgroups() == []
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tp.record_memory_history(True) is False
    assert "profile_memory" in str(caught[0].message) and tp.dump_memory_snapshot("/nonexistent") is False
    with pytest.raises(tp.PrivateTorchMissing, match="PipelineStage.args_recv_info"):
        tp.receive_just_in_time(object())
    tp.answer_stage_votes(object())               # a torch before the vote (2.11): nothing to answer
    assert tp.lowered_pipeline_order(object()) is None          # gpipe / 1f1b, or a torch without the list
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert not tp.can_count_holders() and not tp.only_holders(torch.ones(1), 2)
    buffer = torch.ones(2)                        # a receive's buffer; a model-level input has none (2.11: no flag)
    assert tp._recv_buffer(type("RecvInfo", (), {"is_root_arg": False, "buffer": buffer})()) is buffer
    assert tp._recv_buffer(type("RootArg213", (), {"is_root_arg": True, "buffer": buffer})()) is None
    assert tp._recv_buffer(type("RootArgPlaceholder211", (), {"meta": buffer})()) is None
    laid_out = torch.empty(2, 3, device="meta", requires_grad=True)     # an input buffer of a stage with backward
    real = tp._same_buffer_on(laid_out, "cpu")
    assert real.requires_grad and real.device.type == "cpu" and real.shape == (2, 3)
    assert tp._same_buffer_on(real, "meta").requires_grad
    assert not tp._same_buffer_on(torch.empty(2, device="meta"), "cpu").requires_grad
    half = type("HalfVote", (), {"_warmup_forward_vote": None})()
    with pytest.raises(tp.PrivateTorchMissing, match="PipelineStage._warmup_backward_result"):
        tp.answer_stage_votes(half)


def test_skip_under_compile_keeps_a_function_out_of_dynamo(monkeypatch):
    """A skipped function runs eagerly inside a compiled caller (the caller breaks its graph at
    the call): it never sees ``is_compiling()``; unskipped, Dynamo traces it."""
    import torch._dynamo

    torch._dynamo.reset()
    traced, skipped = [], []

    def f_traced(x):                  # two code objects: Dynamo's guards match functions by code
        traced.append(torch.compiler.is_compiling())
        return x + 1

    def f_skipped(x):
        skipped.append(torch.compiler.is_compiling())
        return x + 1

    tp.skip_under_compile(f_skipped)
    assert torch.compile(lambda x: f_traced(x * 2) * 3, backend="eager")(torch.ones(2)).tolist() == [9.0, 9.0]
    assert torch.compile(lambda x: f_skipped(x * 2) * 3, backend="eager")(torch.ones(2)).tolist() == [9.0, 9.0]
    assert True in traced and skipped == [False]
    monkeypatch.delattr(torch._dynamo.decorators, "skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.skip_under_compile(lambda x: x)
    assert "recompile warnings; results unchanged" in str(caught[0].message)
    torch._dynamo.reset()
