"""Collectives with autograd for the q×q tensor grid (2D tensor parallelism).

Activation layout: rank (i, j) holds batch block i and hidden block j of a
[b, s, h] activation, i.e. [b/q, s, h/q]. ``mesh.row`` groups the q ranks of my
grid row (same batch block, the q hidden blocks); ``mesh.col`` the q ranks of my
grid column (same hidden block, the q batch blocks).

==========================  ==============================  ==============================
function                    forward                         backward
==========================  ==============================  ==============================
``gather_along(x, ax, d)``  all-gather along ``ax``, dim d  reduce-scatter along ``ax``
``reduce_scatter_along``    reduce-scatter along ``ax``     all-gather along ``ax``
``split_batch(x, m, d)``    keep batch block i of dim d     all-gather on ``col``, then
                                                            all-reduce on ``row``
``gather_vector(v, ax)``    all-gather along ``ax`` (once  reduce-scatter along ``ax``
                            per window of ``GatheredVectors``)
==========================  ==============================  ==============================

Why each backward is right (every rank computes the same global loss L and
backpropagates through its own graph, so a rank's upstream gradient is the exact
∂L/∂(its output)):

* ``gather_along``: y = [x_0 … x_{q−1}] is used *differently* on every member (e.g. a
  parameter shard gathered along the column and applied to a different batch
  block on each member), so ∂L/∂x_k = Σ_members (∂L/∂y)[block k]: reduce-scatter.
  Used for biases and norm weights stored as out/q² shards.
* ``reduce_scatter_along``: the adjoint of the above: all-gather.
* ``gather_vector``: ``gather_along`` for a parameter vector (bias, norm weight), whose
  value does not change within an optimizer step: inside a :class:`GatheredVectors` window
  the gathered copy is reused (below), the backward is the same reduce-scatter.
* ``split_batch``: the input is replicated on all q² ranks; rank (i, j) feeds its
  batch block i to its part j of the computation, so ∂L/∂X[block i] is the sum over
  the row, and the full ∂L/∂X the concatenation over the column.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..errors import check_divisible
from . import collectives as C
from .dual_ops import gather_sequence, reduce_scatter_sequence


class _SplitBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return x.chunk(mesh.q, dim)[mesh.grid_row].contiguous()

    @staticmethod
    def backward(ctx, g):
        g = C.all_reduce(g, ctx.mesh.row)
        return C.all_gather(g, ctx.mesh.col, ctx.dim), None, None


class GatheredVectors:
    """Gathered 2D parameter vectors (biases, norm weights), kept for one *window* in which no
    parameter changes: the forwards and backwards of one optimizer step (every micro-batch,
    recompute). Outside a window nothing is kept and :func:`gather_vector` gathers on every
    call, so a forward after any write (optimizer step, checkpoint load, ``.data``) is always
    current; inside one, each vector is all-gathered once.

    One instance per parallelized model (:class:`gridshard.parallel.ParallelContext`
    ``.vector_cache``, passed to its 2D layers' constructors as ``vector_cache``); the trainer opens
    the window around a step's forwards and backwards. Every member of a gathering axis opens
    and closes the same windows, so all members decide alike whether to gather."""

    def __init__(self):
        self._kept = None                  # {id(shard): (shard, gathered)} while open

    @contextlib.contextmanager
    def window(self):
        """Keep gathered vectors until the block exits (parameters must not change inside)."""
        if self._kept is not None:
            raise RuntimeError("GatheredVectors.window() is already open; windows do not nest. Fix: "
                               "open one window per optimizer step, around its forwards and backwards.")
        self._kept = {}
        try:
            yield self
        finally:
            self._kept = None

    @property
    def open(self) -> bool:
        return self._kept is not None

    def lookup(self, shard: torch.Tensor):
        hit = None if self._kept is None else self._kept.get(id(shard))
        return hit[1] if hit is not None and hit[0] is shard else None

    def keep(self, shard: torch.Tensor, gathered: torch.Tensor) -> None:
        if self._kept is not None:
            self._kept[id(shard)] = (shard, gathered)


class _GatheredVector(torch.autograd.Function):
    """Forward: the already gathered vector (a view of the cache); backward: reduce-scatter of
    its gradient to the shard, as :func:`gather_along` (member k gets Σ_members g[block k])."""

    @staticmethod
    def forward(ctx, shard, gathered, axis):
        ctx.axis = axis
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, g):
        return C.reduce_scatter(g, ctx.axis, 0), None, None


def gather_vector(shard: torch.Tensor, axis, cache: Optional[GatheredVectors] = None) -> torch.Tensor:
    """All-gather a parameter vector [n/q] along ``axis`` → [n] (member order); backward
    reduce-scatter of the gradient, exactly as :func:`gather_along`.

    With an open :class:`GatheredVectors` window the gathered copy is reused by every later
    forward in the window: one all-gather of n·e bytes per optimizer step instead of one per
    forward (M micro-batches, recompute: 1 instead of M or 2M). The reduce-scatter of the
    gradient still runs in every backward, so gradients reach the owner shards as before."""
    if axis.size == 1:
        return shard
    return _GatheredVector.apply(shard, _full_vector(shard, axis, cache), axis)


@C.eager
def _full_vector(shard: torch.Tensor, axis, cache: Optional[GatheredVectors]) -> torch.Tensor:
    """The gathered vector of ``shard``: the window's kept copy, or an all-gather (kept while a
    window is open). Eager under ``torch.compile`` (:func:`collectives.eager`): whether the cache
    holds the vector is Python state Dynamo would guard on, recompiling as the window fills."""
    full = cache.lookup(shard) if cache is not None and cache.open else None
    if full is None:
        with torch.no_grad():
            full = C.all_gather(shard.detach(), axis, 0)
        if cache is not None:
            cache.keep(shard, full)
    return full


def gather_along(x: torch.Tensor, axis, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along ``axis`` (member order) on ``dim``; backward reduce-scatter.

    The same dual pair as sequence parallelism's entry (:func:`dual_ops.gather_sequence`)."""
    return gather_sequence(x, axis, dim)


def reduce_scatter_along(x: torch.Tensor, axis, dim: int = 0) -> torch.Tensor:
    """Forward reduce-scatter along ``axis`` on ``dim`` (member k keeps block k); backward all-gather."""
    if axis.size > 1:
        check_divisible(x.shape[dim], axis.size, f"size of dim {dim} of a {tuple(x.shape)} tensor",
                        f"the '{axis.name}' group size")
    return reduce_scatter_sequence(x, axis, dim)


def split_batch(x: torch.Tensor, mesh, dim: int = 0) -> torch.Tensor:
    """Keep batch block ``mesh.grid_row`` of a tensor replicated on every rank of the grid.

    Raises ShapeError before any collective when the batch is not divisible by q.
    """
    check_divisible(x.shape[dim], mesh.q, "batch", "grid side q",
                    f"use a batch that is a multiple of q={mesh.q}")
    if mesh.q == 1:
        return x
    return _SplitBatch.apply(x, mesh, dim)
