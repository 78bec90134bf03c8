"""Every private PyTorch name gridshard calls, in one place, each behind a gate (issue 39).

A private name can change or vanish in any torch release. Each wrapper below looks its name up on
the torch it runs on; where the name is missing it falls back to public API that gives the same
result (slower, or without an overlap), or, where no public API can, raises one error naming the
torch version, what needs the name and the fix. ``tests/test_torch_private.py`` runs every wrapper
on the pinned torch (2.13) and every fallback with its private name hidden; the whole suite was also
run under torch 2.11, a lent GPU machine's (docs/gpu.md, "On the device's torch"). This module imports
nothing of gridshard.

=========================  ==========================================  ================================
wrapper                    private name (why no public one does)       without it
=========================  ==========================================  ================================
``in_backward``            ``_C._current_graph_task_id`` (-1 outside   error: a forward run inside
                           a backward pass; full recompute's second    backward cannot be told apart
                           forward runs inside one)
``will_execute``           ``_C._will_engine_execute_node`` (what      False: the 1D input-gradient
                           ``register_multi_grad_hook`` uses)          collective is not overlapped
``outer_saved_hooks``      ``_C._autograd._top_saved_tensors_default_  error: the recompute rebuild
                           hooks`` (only the innermost saved-tensor    would bypass outer hooks
                           hooks run; AOT autograd reads it too)
``assert_async``           ``_assert_async`` (checks on the device     a synchronous check
                           without a host sync)
``foreach_norm``,          ``_foreach_norm``, ``_foreach_mul_`` (one   one call per tensor
``foreach_mul_``           kernel per group, as torch's optimizers)
``flatten_mesh``           ``DeviceMesh._flatten`` (torch ≥ 2.6 has    error (the package needs
                           no public flattening)                       torch ≥ 2.6)
``set_group_timeout``      ``distributed_c10d._set_pg_timeout``        the group keeps the backend's
                           (torchtitan uses it too)                    default timeout, with a warning
``default_store``          ``distributed_c10d._get_default_store``     None: a collective timeout
                           (the world's rendezvous store; no public    names this rank's call only,
                           getter)                                     not the peers that missed it
``live_subgroups``          ``distributed_c10d._world.pg_map`` (the     an empty list: the test
                           process's groups; no public list of them)   harness keeps every group
``record_memory_history``, ``cuda.memory._record_memory_history``,    a warning; traces are
``dump_memory_snapshot``   ``_dump_snapshot`` (the allocator's         written, memory snapshots
                           history; no public API in 2.13)             are not
``register_fake_backend``  ``testing._internal.distributed.fake_pg``   error: ``gridshard emulate``
                           (importing it registers torch's "fake"      cannot run
                           process-group backend)
``answer_stage_votes``     ``PipelineStage._warmup_forward_vote`` /    both gone (torch ≤ 2.11, no
                           ``_warmup_backward_result`` (the stages'    vote): nothing to answer; one
                           metadata vote goes through the group,       gone: error, ``gridshard
                           which the fake backend cannot answer)       emulate`` cannot run a pipeline
``receive_just_in_time``   ``PipelineStage.args_recv_info`` /          error: a pipeline stage cannot
                           ``grad_recv_info`` / ``_prepare_*_infra``   be built
                           (the receive buffers, allocated for every
                           micro-batch up front and kept;
                           pytorch/pytorch#136380)
``lowered_pipeline_order`` ``_PipelineScheduleRuntime.pipeline_      None: sends are given back at
                           order_with_comms`` and its ``_Action``s     the step's end, as torch does
                           (each rank's compute, send and receive      (more memory, same results)
                           actions in run order; no public view)
``only_holders``           ``Tensor._use_count``, ``_C._storage_Use_   False: nothing is given back
                           Count`` (who refers to a tensor and its     early (as above)
                           storage; no public count)
``skip_under_compile``     ``_dynamo.decorators.skip`` (Dynamo         the wrapper frames compile per
                           neither inlines nor compiles the frame;     argument shape (torch's
                           ``torch.compiler.disable`` would wrap it    recompile-limit warnings),
                           and import Dynamo at every gridshard        results unchanged
                           import)
``tree_flatten``,          ``utils._pytree``, ``utils._python_         error at import: testing and
``tree_map_only``,         dispatch`` (no public module in 2.6)        ZeRO-3's gather need them
``TorchDispatchMode``
=========================  ==========================================  ================================
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


class PrivateTorchMissing(RuntimeError):
    """A private torch name gridshard needs, with no public stand-in, is missing from this torch."""


def _missing(name: str, needed_by: str) -> PrivateTorchMissing:
    return PrivateTorchMissing(f"torch {torch.__version__} has no {name}, which {needed_by} needs. Fix: install the "
                               f"pinned torch (pip install torch==2.13.0), or a release between 2.6 and 2.13.")


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:
        raise _missing("torch._C._current_graph_task_id", "telling full recompute's forward from the first")
    return task() != -1


def will_execute(node) -> bool:
    """Whether the running backward will execute autograd ``node``; False where torch cannot say."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    return bool(check(node)) if check is not None else False


def outer_saved_hooks():
    """The (pack, unpack) pair of the enclosing ``saved_tensors_hooks``, or None."""
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    if top is None:
        raise _missing("torch._C._autograd._top_saved_tensors_default_hooks", "the recompute rebuild (nn/rebuild.py)")
    return top(True)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Fail the run if ``condition`` (a 0-dim bool tensor) is false, without a host sync where torch can."""
    check = getattr(torch, "_assert_async", None)
    if check is not None:
        check(condition, message)
    elif not bool(condition):
        raise RuntimeError(message)


def foreach_norm(tensors: list) -> list:
    """The 2-norm of each tensor."""
    norm = getattr(torch, "_foreach_norm", None)
    return list(norm(tensors)) if norm is not None else [torch.linalg.vector_norm(t) for t in tensors]


def foreach_mul_(tensors: list, factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim ``factor``."""
    mul = getattr(torch, "_foreach_mul_", None)
    if mul is not None:
        mul(tensors, factor)
    else:
        for t in tensors:
            t.mul_(factor)


def flatten_mesh(device_mesh, name: str):
    """One mesh dim over the dims of ``device_mesh`` (a slice of a DeviceMesh), named ``name``."""
    flatten = getattr(device_mesh, "_flatten", None)
    if flatten is None:
        raise _missing("DeviceMesh._flatten", "the flattened tensor and data × context mesh dims")
    return flatten(name)


def set_group_timeout(timeout, group) -> None:
    """Give process ``group`` this ``timeout`` (a timedelta)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        warnings.warn(f"torch {torch.__version__} cannot change a process group's timeout: the mesh's groups keep "
                      f"the backend's default, not train.collective_timeout_s", stacklevel=2)
        return
    setter(timeout, group)


def default_store():
    """The key-value store the default process group was created with, or None (not initialised, or
    the private getter is gone)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def live_subgroups() -> list:
    """The process groups this process holds other than the default one (empty when none, when not
    initialised, or where the private registry is gone)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = getattr(world, "pg_map", None)
    if groups is None or not dist.is_initialized():
        return []
    default = dist.group.WORLD
    return [pg for pg in list(groups) if pg is not default]


def record_memory_history(enabled: bool, max_entries: int = 100_000) -> bool:
    """Start (``enabled``) or stop recording the CUDA caching allocator's history; False (with a
    warning) where this torch has no such call."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        warnings.warn(f"torch {torch.__version__} cannot record CUDA memory history: train.profile_memory writes no "
                      f"snapshots", stacklevel=2)
        return False
    if enabled:
        record(max_entries=max_entries)
    else:
        record(enabled=None)
    return True


def dump_memory_snapshot(path: str) -> bool:
    """Write the recorded CUDA memory history to ``path`` (a pickle torch's memory_viz reads; gridshard
    only writes it); False where this torch cannot."""
    dump = getattr(torch.cuda.memory, "_dump_snapshot", None)
    if dump is None:
        return False
    dump(path)
    return True


def register_fake_backend() -> None:
    """Make torch's "fake" process-group backend (collectives that return at once, moving no data)
    available to ``init_process_group`` (importing the module registers it, once per process)."""
    import importlib

    try:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")
    except ImportError:
        raise _missing("torch.testing._internal.distributed.fake_pg", "gridshard emulate (the fake process group)") \
            from None


def answer_stage_votes(stage) -> None:
    """Under the fake process group (``gridshard emulate``): answer a ``PipelineStage``'s start-up vote
    on static or dynamic tensor metadata locally with "static" — what every stage of a gridshard job
    votes, since each is built with its input and output shapes — instead of through the group,
    whose fake receive would read as "dynamic" and start a metadata exchange no one answers. A torch
    without the vote (2.11 and before: a stage built with its shapes exchanges no metadata) has
    nothing to answer; one with half of it cannot be answered."""
    names = ("_warmup_forward_vote", "_warmup_backward_result")
    present = [hasattr(stage, name) for name in names]
    if not any(present):
        return
    if not all(present):
        raise _missing(f"PipelineStage.{names[present.index(False)]}", "gridshard emulate of a pipeline layout")
    stage._warmup_forward_vote = lambda has_backward, received_acc=None: torch.ones(1, dtype=torch.int32)
    stage._warmup_backward_result = lambda received_result=None: torch.ones(1, dtype=torch.int32)


_RECEIVE_NAMES = ("args_recv_info", "grad_recv_info", "_prepare_forward_infra", "_prepare_backward_infra",
                  "get_fwd_recv_ops", "get_bwd_recv_ops", "set_local_bwd_input", "forward_one_chunk",
                  "backward_one_chunk", "has_backward", "device")


def receive_just_in_time(stage) -> None:
    """A ``PipelineStage`` whose receive buffers exist only while a micro-batch needs them.

    torch's stage allocates, when its schedule first runs, one buffer per micro-batch for its input
    and one for its output's gradient, and keeps all 2·A of them for good (pytorch/pytorch#136380):
    at Narayanan et al.'s 1T layout (A = 512 micro-batches of 105 MB blocks) that is 100 GiB per
    GPU. Here the stage lays its buffers out on the meta device (no memory) and each becomes a real
    tensor when its receive is posted (``get_fwd_recv_ops`` / ``get_bwd_recv_ops``) and a meta
    tensor again once the micro-batch's backward has run (its forward, where the stage runs no
    backward). An input buffer then lives exactly while its micro-batch is in flight (it is the
    tensor the stage's first layer keeps), and an output-gradient buffer from its receive to its
    micro-batch's backward: what Megatron allocates (:func:`gridshard.theory.pipeline.stage_buffer_bytes`).
    A stage's own, same-rank passes (V-shaped schedules: ``set_local_fwd_input`` / ``set_local_bwd_input``)
    hand over real tensors as before. Only a stage built with its input and output shapes (every
    gridshard stage) lays out its buffers without running the module."""
    missing = [name for name in _RECEIVE_NAMES if not hasattr(stage, name)]
    if missing:
        raise _missing(f"PipelineStage.{missing[0]}", "the pipeline's receive buffers")
    meta = torch.device("meta")

    def materialize(infos, fill=None) -> None:
        for info in infos:
            buffer = _recv_buffer(info)
            if buffer is not None and buffer.device == meta:
                info.buffer = _same_buffer_on(buffer, stage.device)
                if fill is not None:
                    info.buffer.fill_(fill)

    def release(infos) -> None:
        for info in infos:
            buffer = _recv_buffer(info)
            if buffer is not None and buffer.device != meta:
                info.buffer = _same_buffer_on(buffer, meta)

    def laid_out_on_meta(prepare):
        def run(*args, **kwargs):
            device, stage.device = stage.device, meta
            try:
                return prepare(*args, **kwargs)
            finally:
                stage.device = device
        return run

    def before(method, infos_of):
        def run(chunk, *args, **kwargs):
            materialize(infos_of().get(chunk, ()))
            return method(chunk, *args, **kwargs)
        return run

    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        out = forward(chunk, *args, **kwargs)
        if not (stage.has_backward and torch.is_grad_enabled()):
            release(stage.args_recv_info.get(chunk, ()))
        return out

    def backward_one_chunk(chunk, *args, **kwargs):
        out = backward(chunk, *args, **kwargs)
        release(stage.args_recv_info.get(chunk, ()))
        release(stage.grad_recv_info.get(chunk, ()))
        return out

    stage._prepare_forward_infra = laid_out_on_meta(stage._prepare_forward_infra)
    stage._prepare_backward_infra = laid_out_on_meta(stage._prepare_backward_infra)
    stage.get_fwd_recv_ops = before(stage.get_fwd_recv_ops, lambda: stage.args_recv_info)
    stage.get_bwd_recv_ops = before(stage.get_bwd_recv_ops, lambda: stage.grad_recv_info)
    stage.set_local_bwd_input = _local_bwd_input(stage, materialize)
    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _same_buffer_on(buffer: torch.Tensor, device) -> torch.Tensor:
    """An uninitialised tensor like ``buffer`` on ``device``, keeping whether it requires a gradient:
    torch 2.11's stage marks an input buffer ``requires_grad`` once, when it lays it out, and reads the
    input gradient from it after backward (2.13 sets the flag at each forward); ``empty_like`` alone
    drops the flag, and the stage then had no gradient to send back."""
    return torch.empty_like(buffer, device=device).requires_grad_(buffer.requires_grad)


def _recv_buffer(info):
    """A stage input's receive buffer; None for a model-level input, which is handed in, not received
    (torch 2.13: a ``_RecvInfo`` with ``is_root_arg``; 2.11: a ``_RootArgPlaceholder``, no buffer)."""
    return None if getattr(info, "is_root_arg", False) else getattr(info, "buffer", None)


def _local_bwd_input(stage, materialize):
    """``set_local_bwd_input`` of :func:`receive_just_in_time`: a gradient the same-rank next stage did
    not produce is zeros in a real buffer (torch zeroes the kept one)."""
    local = stage.set_local_bwd_input

    def run(grads, chunk):
        materialize(stage.grad_recv_info.get(chunk, ()), fill=0)
        return local(grads, chunk)
    return run


def lowered_pipeline_order(schedule):
    """Each pipeline rank's actions in the order ``schedule`` runs them, ``{rank: [(kind, stage,
    micro-batch)]}`` with kind one of ``F``, ``B`` (full backward), ``I`` (input backward), ``W``,
    ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B`` (FSDP's own actions left out), plus ``{stage:
    rank}``; None for a schedule that does not run a lowered list (``gpipe``, ``1f1b``), an action
    kind not known here, or a torch without the list."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    stage_rank = getattr(schedule, "stage_index_to_group_rank", None)
    if not isinstance(order, dict) or not isinstance(stage_rank, dict):
        return None
    known = {"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    out = {}
    for rank, actions in order.items():
        rows = []
        for action in actions:
            kind = getattr(getattr(action, "computation_type", None), "value", None)
            if kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
                continue
            if kind not in known:
                return None
            rows.append((kind, action.stage_index, action.microbatch_index))
        out[rank] = rows
    return out, dict(stage_rank)


def can_count_holders() -> bool:
    """Whether :func:`only_holders` can tell on this torch."""
    return hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")


def only_holders(tensor: torch.Tensor, references: int) -> bool:
    """True when at most ``references`` holders refer to ``tensor`` (a Python object counts once, a
    ``Work`` holding it once more) and no other tensor shares its storage; False where this torch
    cannot say."""
    if not can_count_holders():
        return False
    storage = tensor.untyped_storage()
    # the storage's holders less the reference ``storage`` itself holds: ``tensor`` alone
    return tensor._use_count() <= references and torch._C._storage_Use_Count(storage._cdata) - 1 == 1


def skip_under_compile(fn) -> None:
    """Dynamo graph-breaks at a call of ``fn`` instead of inlining it, and leaves ``fn``'s own
    frame uncompiled (frames that ``fn`` calls are treated as usual). Imports Dynamo."""
    try:
        from torch._dynamo.decorators import skip
    except ImportError:
        warnings.warn(f"torch {torch.__version__} has no torch._dynamo.decorators.skip: under train.compile "
                      f"gridshard's collective wrappers compile per argument shape (slower first step, "
                      f"recompile warnings; results unchanged)", stacklevel=2)
        return
    skip(fn)


try:
    from torch.utils._pytree import tree_flatten, tree_map_only
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as e:                        # pragma: no cover - the pinned torch has them
    raise _missing("torch.utils._pytree / torch.utils._python_dispatch", "ZeRO-3's gather and the test meters") from e


__all__ = ["in_backward", "will_execute", "outer_saved_hooks", "assert_async", "foreach_norm", "foreach_mul_",
           "flatten_mesh", "set_group_timeout", "live_subgroups", "receive_just_in_time", "skip_under_compile", "tree_flatten",
           "tree_map_only", "TorchDispatchMode",
           "PrivateTorchMissing"]
