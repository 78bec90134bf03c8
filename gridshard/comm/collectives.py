"""Recorded collectives: every collective gridshard issues on the job's tensors — the
tensor-parallel layers' dual functions, SUMMA, the data-parallel gradient reduction and
ZeRO's gathers, the gradient norm, the tied-embedding sum across stages, the trainer's
metric reductions — is one of these functions, recorded in the ledger (unless paused, as
the metric reductions are).

Other modules call ``torch.distributed`` themselves, for work the ledger does not count:

* process groups: :mod:`gridshard.mesh` (``init_process_group``, DeviceMesh),
  :mod:`gridshard.pipeline.tied` (the first/last stage pair's group),
  :mod:`gridshard.checkpoint.checkpointer` (its own gloo group), the test harness;
* small Python objects, once per run or per checkpoint: :mod:`gridshard.engine.trainer`
  (rank 0's run directory), :mod:`gridshard.checkpoint.checkpointer` and
  :mod:`gridshard.checkpoint.reader` (barriers, verdicts and refusals on the checkpoint
  group), :mod:`gridshard.cli` (the barrier before a worker tears down);
* PyTorch components that move tensors themselves: ``torch.distributed.checkpoint``
  (:mod:`gridshard.checkpoint`, on the checkpointer's own group) and the
  ``torch.distributed.pipelining`` schedules (:mod:`gridshard.pipeline.runner`; their sends
  are recorded by :class:`gridshard.pipeline.meter.StageMeter` through the same
  :func:`gridshard.comm.ledger.record`);
* measuring the machine: :mod:`gridshard.planner.calibrate` and
  :mod:`gridshard.planner.calibrate_reference` time raw collectives (recording would only
  add overhead to what they time);
* questions to the process group, no communication: :mod:`gridshard.engine.job` and
  :mod:`gridshard.engine.warmup` (whether it is up, its world size), :mod:`gridshard.device`
  (its backend); :mod:`gridshard.launch` starts the workers (the elastic launcher).

Each function here

* is a no-op (returns its input or a view of it) on an axis of size 1, recording nothing;
* records the call through :func:`gridshard.comm.ledger.record` (the one route: the axis's
  mesh ledger, else the current one; nothing while paused) with the payload bytes defined
  there (full tensor for all-gather/reduce-scatter).

Shapes (group of n ranks, ``dim`` = d):

* ``all_reduce(x)``: x → x summed over the group, on a contiguous copy; ``inplace=True``:
  in x itself, no copy — what callers pass when x is a temporary nobody reads afterwards
  (norm and loss statistics, verdicts, the gradient norm, loss sums, flags). A copy is kept
  where x is held elsewhere: a forward's input or a backward's incoming gradient (autograd
  may hand the same gradient tensor to several branches) and the early input-gradient
  collective, whose source is compared and may still be read.
* ``all_gather(x, d)``: local [.., m, ..] → [.., n·m, ..], member k's block at k·m.
* ``reduce_scatter(x, d)``: [.., n·m, ..] → member k gets the sum over ranks of block k.

  Both are copy-free (besides the transfer) when d is the outermost dim of the tensor in
  memory, and then keep that layout (the result is a view with d outermost); otherwise
  they reorder through one extra copy and return a contiguous tensor.
* ``broadcast(x, src)``: x on group member ``src`` → every member (async optional).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist

from ..mesh import Axis
from .ledger import record


def eager(fn):
    """Run the collective ``fn`` eagerly under ``torch.compile`` (``train.compile``), as a graph
    break: neither the process-group call nor the ledger's bookkeeping is traced (traced, the
    ledger's counters became guards that recompiled every call).

    Outside compilation ``run`` calls ``fn`` directly, and Dynamo is never imported for it (an
    import costs a second per process, and ``gridshard plan`` never compiles).
    :func:`compile_eagerly` (called by :func:`gridshard.parallel.compile.apply_compile` before any
    layer compiles) gives every collective ``torch.compiler.disable(fn)`` to call and has Dynamo
    skip the wrappers (:func:`gridshard.torch_private.skip_under_compile`): a compiled caller
    breaks its graph at the call, and the wrapper's own frame is neither inlined nor compiled.
    Without the skip (before this, or where torch lacks the private name) Dynamo compiled each
    wrapper frame once per argument shape: at 3D (q = 2) the wrapper of every collective together
    hit torch's recompile limit (8) in the first step, and every run printed its warning."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if run.under_compile is None:
            return fn(*args, **kwargs)
        return run.under_compile(*args, **kwargs)

    run.under_compile = None
    _EAGER.append(run)
    return run


_EAGER: list = []          # every @eager wrapper, in definition order (filled once, at import)


def compile_eagerly() -> None:
    """Prepare every collective for ``torch.compile``d callers (idempotent; see :func:`eager`).
    Imports Dynamo (``torch.compiler.disable``): call it only when something compiles."""
    from ..torch_private import skip_under_compile

    for run in _EAGER:
        if run.under_compile is None:
            run.under_compile = torch.compiler.disable(run.__wrapped__)
        skip_under_compile(run)


# torch >= 2.13 names the flat-buffer collectives *_single; older releases *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_staged(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False, staging=None):
    """All-gather ``x`` [m] into ``out`` [n·m]. gloo with a ``staging`` buffer (≥ n·m elements of
    ``x``'s dtype, e.g. a ZeRO-3 unit's own mapping, :mod:`gridshard.zero.pages`): ``x`` copied
    into each of its n blocks, then an all-to-all into ``out`` (member k receives block k of every
    member: member j's ``x``; the bytes on the wire are the all-gather's, (n − 1)·m per member),
    so nothing is allocated — gloo's own all-gather allocates an n·m output and an m input copy
    per call, which on CPU land in glibc's heap (docs/memory.md "Resident memory on CPU").
    Otherwise the backend's all-gather. ``staging`` must stay untouched until the op is done."""
    if staging is None or dist.get_backend(group) != "gloo":
        return _all_gather_flat(out, x, group=group, async_op=async_op)
    n = out.numel() // x.numel()
    send = staging[:out.numel()]
    send.view(n, x.numel()).copy_(x.reshape(1, -1).expand(n, -1))
    return dist.all_to_all_single(out, send, group=group, async_op=async_op)


def _reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False, staging=None):
    """Reduce-scatter ``x`` [n·m, ...] (member order in dim 0) into ``out`` [m, ...].

    NCCL (and any backend but gloo): the backend's reduce-scatter. gloo: an all-to-all of the
    n blocks (member k receives every member's block k: (n − 1)/n of the payload on the
    wire, exactly a ring reduce-scatter's bytes) and a local sum of the n received blocks in
    member order, the same on every member. Written by hand because gloo has no reduce-scatter
    of its own: torch's gloo backend all-reduces the whole input and keeps one block, which
    costs a full all-reduce (2(n − 1)/n of the payload, every rank summing all n blocks).
    Measured on 2 CPU cores, 4 ranks, 8 MiB fp32, median of 11 (``docs/benchmarks.md``):
    reduce_scatter_tensor 19–27 ms wall / 8–10 CPU-ms, all_reduce 19–25 / 9–14, this
    all-to-all + sum 11–13 / 5. Returns ``None``, or with ``async_op`` a work handle whose
    ``wait()`` completes ``out`` (the sum runs there). ``staging``: a buffer of ≥ n·m elements of
    ``x``'s dtype the blocks are received in (else one is allocated), untouched until done."""
    if dist.get_backend(group) != "gloo":
        return _native_reduce_scatter_flat(out, x, group=group, async_op=async_op)
    n = x.shape[0] // out.shape[0]
    received = torch.empty_like(x) if staging is None else staging[:x.numel()].view(x.shape)
    work = dist.all_to_all_single(received, x, group=group, async_op=async_op)

    def finish():
        torch.sum(received.view((n,) + tuple(out.shape)), dim=0, out=out)

    if not async_op:
        finish()
        return None
    return _FinishAfter(work, finish)


class _FinishAfter:
    """A work handle whose ``wait()`` waits for ``work`` and then runs ``finish()`` once."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._finish()
            self._work = None
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_requested(x: torch.Tensor, async_op: bool):
    """A result with nothing to wait for (an axis of size 1): ``x``, or a handle already done."""
    return PendingCollective(None, x, None) if async_op else x


def _issue(call, entry, result: torch.Tensor, async_op: bool, device):
    """Run the process-group call ``call(async_op)``: with ``async_op`` return a
    :class:`PendingCollective` whose ``wait()`` is timed into ``entry``; otherwise time the
    call itself and return ``result``. While the job's profiler ranges are on
    (:mod:`gridshard.engine.profiling`) the call is the range ``gridshard.{op} {axis} {bytes} B``."""
    ranges = entry.owner.ranges
    if ranges is not None and ranges.on:
        with ranges(f"gridshard.{entry.op} {entry.axis} {entry.last_bytes} B"):
            return _run(call, entry, result, async_op, device)
    return _run(call, entry, result, async_op, device)


def _run(call, entry, result: torch.Tensor, async_op: bool, device):
    if async_op:
        return PendingCollective(call(True), result, entry)
    with entry.owner.timed(entry, device):
        call(False)
    return result


def _profiled_wait(entry):
    """While the ledger's job records a trace, the range of the wait for ``entry``'s asynchronous
    call; else a no-op context. The name is built only while recording."""
    ranges = entry.owner.ranges
    if ranges is None or not ranges.on:
        return contextlib.nullcontext()
    return ranges(f"gridshard.wait {entry.op} {entry.axis}")


@eager
def all_reduce(x: torch.Tensor, axis: Axis, op: str = "sum", async_op: bool = False, inplace: bool = False):
    """Sum (or max) ``x`` over ``axis``; returns a new contiguous tensor (``x`` itself with
    ``inplace``, which needs a contiguous ``x`` that the caller no longer reads as it was: module
    docstring). The ledger entry is the same either way (payload ``x``'s bytes). With
    ``async_op`` returns a :class:`PendingCollective`; the ledger times only the wait."""
    if axis.size == 1:
        return _as_requested(x, async_op)
    if inplace and not x.is_contiguous():
        raise ValueError("all_reduce(inplace=True) needs a contiguous tensor")
    out = x if inplace else x.clone(memory_format=torch.contiguous_format)
    entry = record("all_reduce", axis, _nbytes(out))
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    return _issue(lambda a: dist.all_reduce(out, op=red, group=axis.group, async_op=a), entry, out, async_op,
                  out.device)


@eager
def all_gather(x: torch.Tensor, axis: Axis, dim: int = -1, async_op: bool = False):
    """Concatenate every member's ``x`` along ``dim`` in group-rank order.

    Layout: when ``dim`` is the outermost dim of ``x`` in memory (``x.movedim(dim, 0)`` is
    contiguous: always for dim 0; for a [b, s/n, h] block stored sequence-first as the
    sequence-parallel layers leave it, :mod:`gridshard.comm.dual_ops`) the members' blocks
    are received straight into one buffer with that dim outermost and the result is returned
    as a view in the same layout: no copy besides the receive. Otherwise the blocks are
    gathered on dim 0 and concatenated along ``dim`` (one extra copy of the output, which is
    then contiguous). With ``async_op`` (an outermost ``dim`` only) a
    :class:`PendingCollective` is returned (its ``wait()`` gives the gathered tensor)."""
    if axis.size == 1:
        return _as_requested(x, async_op)
    n = axis.size
    dim = dim % x.dim()
    lead = x.movedim(dim, 0)
    outermost = lead.is_contiguous()
    if async_op and not outermost:
        raise ValueError(f"all_gather(async_op=True) needs dim {dim} outermost in memory; got strides {x.stride()}")
    src = lead if outermost else x.contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    entry = record("all_gather", axis, _nbytes(out))
    result = _issue(lambda a: _all_gather_flat(out, src, group=axis.group, async_op=a), entry, out.movedim(0, dim),
                    async_op, x.device)
    return result if outermost or async_op else torch.cat(out.chunk(n, 0), dim=dim)     # async: outermost only


@eager
def all_gather_into(out: torch.Tensor, x: torch.Tensor, axis: Axis, async_op: bool = False, staging=None):
    """Gather every member's flat ``x`` (m elements) into the flat ``out`` (n·m, member order),
    a persistent buffer; ``x`` may be ``out``'s own chunk of this member (in place, no send
    buffer: NCCL and gloo both accept it). With one member ``x`` is copied into ``out``.
    Ledger payload: ``out``. With ``async_op`` a :class:`PendingCollective` is returned.
    ``staging``: gloo's send buffer of n·m elements (:func:`_all_gather_staged`), untouched until done."""
    if axis.size == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return _as_requested(out, async_op)
    if out.numel() != axis.size * x.numel():
        raise ValueError(f"all_gather_into: out has {out.numel()} elements, not {axis.size}·{x.numel()}")
    entry = record("all_gather", axis, _nbytes(out))
    return _issue(lambda a: _all_gather_staged(out, x, group=axis.group, async_op=a, staging=staging), entry, out,
                  async_op, out.device)


@eager
def reduce_scatter(x: torch.Tensor, axis: Axis, dim: int = -1, async_op: bool = False):
    """Sum ``x`` over the group and keep this member's 1/n block along ``dim``.

    Layout: when ``dim`` is outermost in memory (see :func:`all_gather`) ``x`` is already in
    member order and is reduce-scattered as it is; the block comes back in the same layout
    (a view with ``dim`` outermost). Otherwise the n blocks of ``dim`` are first stacked into
    a contiguous buffer (one copy of the input) and the block is contiguous. With
    ``async_op`` a :class:`PendingCollective` is returned (its ``wait()`` gives the block)."""
    if axis.size == 1:
        return _as_requested(x, async_op)
    n = axis.size
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by the group size {n}")
    lead = x.movedim(dim, 0)
    if lead.is_contiguous():
        # member k receives slab k of the input viewed as [n, *block], with the blocks of ``dim`` in front
        out = torch.empty((lead.shape[0] // n,) + tuple(lead.shape[1:]), dtype=x.dtype, device=x.device)
        src, result = lead, out.movedim(0, dim)
    else:
        block_shape = list(x.shape)
        block_shape[dim] //= n
        out = torch.empty(block_shape, dtype=x.dtype, device=x.device)
        src = torch.stack(x.chunk(n, dim=dim), dim=0).contiguous().view(n * block_shape[0], *block_shape[1:])
        result = out
    entry = record("reduce_scatter", axis, _nbytes(x))
    return _issue(lambda a: _reduce_scatter_flat(out, src, group=axis.group, async_op=a), entry, result, async_op,
                  x.device)


@eager
def reduce_scatter_flat(x: torch.Tensor, axis: Axis, async_op: bool = False, out: Optional[torch.Tensor] = None,
                        staging=None):
    """Sum a flat buffer ``x`` of n·m elements over the group; member k keeps elements
    [k·m, (k+1)·m) (no copy: the segments are already contiguous), in ``out`` when given (a
    persistent m-element buffer, not aliasing ``x``; with one member ``x`` is copied into it).
    Ledger payload: ``x``. With ``async_op`` a :class:`PendingCollective` is returned.
    ``staging``: gloo's receive buffer of n·m elements (:func:`_reduce_scatter_flat`), untouched until done."""
    if axis.size == 1:
        if out is not None:
            x = out.copy_(x)
        return _as_requested(x, async_op)
    n = axis.size
    if x.dim() != 1 or x.numel() % n:
        raise ValueError(f"reduce_scatter_flat: needs a 1-dim buffer of a multiple of {n} elements, got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    entry = record("reduce_scatter", axis, _nbytes(x))
    return _issue(lambda a: _reduce_scatter_flat(out, x, group=axis.group, async_op=a, staging=staging), entry, out,
                  async_op, x.device)


@eager
def all_to_all_uneven(x: torch.Tensor, axis: Axis, send_counts: list, recv_counts: list) -> torch.Tensor:
    """Rows of ``x`` (dim 0) in member order, ``send_counts[k]`` of them for member k, exchanged:
    the result holds ``recv_counts[k]`` rows from each member k, in member order (an MoE layer's
    token dispatch and combine, :mod:`gridshard.moe.dispatch`). Ledger op ``all_to_all_v``, payload
    the bytes sent to the *other* members (this member's own rows stay): exactly the bytes on the
    wire, as ``ring_wire_bytes`` counts an unknown op."""
    if axis.size == 1:
        return x
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    entry = record("all_to_all_v", axis, (sum(send_counts) - send_counts[axis.rank]) * row_bytes)
    src = x.contiguous()
    return _issue(lambda a: dist.all_to_all_single(out, src, list(recv_counts), list(send_counts), group=axis.group,
                                                   async_op=a), entry, out, False, x.device)


class PendingCollective:
    """Handle of an async collective; ``wait()`` returns the received tensor."""

    def __init__(self, work, tensor: torch.Tensor, entry):
        self._work, self.tensor, self._entry = work, tensor, entry
        self._call = entry.owner.last if entry is not None else None       # the ledger's position of the call

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if self._call is not None:
                self._entry.owner.last = dataclasses.replace(self._call, waiting=True)
            with _profiled_wait(self._entry), \
                    self._entry.owner.timed(self._entry, self.tensor.device):
                self._work.wait()
            self._work = None
        return self.tensor


@eager
def broadcast(x: torch.Tensor, axis: Axis, src: int, async_op: bool = False):
    """Send ``x`` from group member ``src`` (an index into ``axis.ranks``) to every member.

    Non-source members pass a buffer of the source's shape and dtype. With
    ``async_op`` a :class:`PendingCollective` is returned; otherwise the tensor.
    """
    if axis.size == 1:
        return _as_requested(x, async_op)
    x = x.contiguous()
    entry = record("broadcast", axis, _nbytes(x))
    return _issue(lambda a: dist.broadcast(x, src=axis.global_rank(src), group=axis.group, async_op=a), entry, x,
                  async_op, x.device)
