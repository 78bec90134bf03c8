"""The gradient reducer: one class, :class:`gridshard.zero.data_parallel.ZeroDataParallel`, for
every ZeRO stage, so the training step never asks which stage it runs; the stage is data read in
a few named branches.

A reducer owns everything that depends on how gradients are reduced over ``mesh.data``:

=====================  ==========================================  ==========================================
                       ZeRO-0                                      ZeRO-1/2/3
=====================  ==========================================  ==========================================
units                  buckets of ≤ ``bucket_bytes``, one part     decoder layers + the root, D parts
gradients              ``.grad`` = views into each unit's flat     the same, reduce-scattered into this
                       buffer, all-reduced in place, ÷ D           rank's chunk (÷ D)
optimizer steps        the parameters (bf16: their fp32 masters)   each parameter's elements in the chunk
norm contributions     every parameter, summed over tensor          the chunks, summed over tensor *and* data
                       (and pipeline) ranks                         (and pipeline) ranks: ``norm_axis``
checkpoint blocks      each parameter's canonical box               the box narrowed to the element range
                                                                    (≤ 3 boxes per matrix)
after the step         nothing                                      ZeRO-1/2: all-gather the updated chunk
gathered state         the parameters as they are                   ZeRO-3: gather every unit first
=====================  ==========================================  ==========================================

One step drives every stage alike::

    reducer.zero_grad()
    for each micro-batch: (reducer.arm() before the last one's backward) forward, backward
    reducer.sync()                           # every stepped tensor's .grad is the data mean
    ‖g‖ over reducer.norm_tensors() (and over reducer.norm_axis); clip; optimizer.step()
    reducer.after_step()

:class:`SteppedTensor` (:mod:`.stepped`, importable from here) is the one record the optimizer,
the norm and the checkpoint read: the parameter's name, the parameter, the tensor stepped and,
for a ZeRO shard, the local elements ``[a, b)`` of the parameter's flattened block it is
(:mod:`gridshard.theory.zero`).
"""
from __future__ import annotations

import torch
from torch import nn

from .data_parallel import ZeroDataParallel
from .stepped import SteppedTensor, whole_parameters   # noqa: F401 (importable from here: gridshard.zero, checkpoint)

__all__ = ["SteppedTensor", "ZeroDataParallel", "build_reducer", "whole_parameters"]


def build_reducer(model: nn.Module, data_axis, zero: int, bucket_bytes: int, overlap: bool,
                  param_dtype: torch.dtype = torch.float32,
                  grad_reduce_dtype: torch.dtype = torch.float32, defer_root: bool = False,
                  host_pages: bool = False, expert_axes=None) -> ZeroDataParallel:
    """The reducer of ``train.zero`` = ``zero`` for ``model`` (laid out by :func:`gridshard.parallelize`)
    over ``data_axis``; registered as ``model.grad_reducer`` (:func:`gridshard.parallel.state_dict.
    gathered_state_dict` gathers through it). ``overlap``: reduce during the backward
(:func:`gridshard.theory.zero.reduces_in_backward`); ``defer_root``: the root unit is reduced in
``sync()`` only (a pipeline's tied-embedding copy, summed across stages after the schedule).

    ``param_dtype`` bf16 (``train.precision: bf16``): the reducer copies the fp32 values into its
    fp32 masters (ZeRO-0: whole; ZeRO ≥ 1: this rank's chunks), then stores every floating
    parameter of ``model`` in bf16 — the one cast of the run; what it steps is the masters, and
    :meth:`~.reduction.GradientReduction.after_step` copies them back. ``grad_reduce_dtype``: the dtype the
    gradients are reduced in (``train.grad_reduce_dtype``). ``host_pages``: ZeRO-3's memory outside glibc's heap on
    a Linux CPU (``train.zero3_host_memory`` through :func:`gridshard.zero.pages.host_pages_in_effect`).
    ``expert_axes``: (``mesh.expert``, ``mesh.expert_data``) at E > 1 (:class:`ZeroDataParallel`)."""
    reducer = ZeroDataParallel(model, data_axis, zero, bucket_bytes, overlap=overlap, param_dtype=param_dtype,
                               grad_reduce_dtype=grad_reduce_dtype, defer_root=defer_root,
                               host_pages=host_pages, expert_axes=expert_axes)
    if param_dtype != torch.float32:                   # parameters without a gradient (frozen) too
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)
    return reducer
