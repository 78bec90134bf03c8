"""Measuring memory on a rank: current RSS, bytes saved for backward, model-state tensors.

These are the measurements :mod:`gridshard.theory.memory` is checked against.

* :func:`rss_now`: the process's resident set size now (Linux ``/proc/self/statm``; falls back
  to the peak RSS elsewhere). The trainer reads it just before building the model: the
  baseline of ``predicted_mem_bytes``.
* :func:`process_peak_rss`: the process's own peak resident set (Linux ``VmHWM``), the CPU
  peak every part of the package reports.
* :class:`SavedTensorMeter`: a context manager around a forward that counts the bytes autograd
  keeps for backward, through ``torch.autograd.graph.saved_tensors_hooks``: every packed
  tensor's *storage* is counted once (views share it), parameters (and any storage passed
  in ``exclude``) are not counted. Non-reentrant checkpointing packs its inputs under the
  outer hooks and its inner activations under its own hooks, so what the meter sees is
  exactly what recomputation keeps.
* :func:`model_state_tensor_bytes`: the bytes of parameters, gradients and optimizer state a
  rank holds (each storage once).
"""
from __future__ import annotations

import contextlib
import os
import resource
import sys

import torch

from ..nn.saved import as_saved


def rss_now() -> int:
    """Resident set size of this process in bytes (where ``/proc`` is missing: the peak,
    :func:`process_peak_rss`)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return process_peak_rss()


def unmap_large_frees(threshold: int = 1 << 20) -> bool:
    """Make the C library hand every allocation of at least ``threshold`` bytes back to the OS when
    it is freed (glibc's ``mallopt(M_MMAP_THRESHOLD)``), so this process's resident set follows its
    live tensors as a CUDA device's allocated bytes do. By default glibc raises its mmap threshold to
    the largest block freed so far (up to 32 MiB) and keeps freed blocks below it in its heap: a
    Llama-7B T8 P4 rank's peak resident set was 1.40× the memory model's, 1.11× with this (the
    first stage, one layer; ``docs/planner.md``, "Emulated ranks"). For a process of its own
    (``gridshard emulate``'s rank): the setting holds until it exits. False where the C library
    has no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3                              # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, int(threshold)))


def process_peak_rss() -> int:
    """The peak resident set of this process's own memory, in bytes: Linux ``VmHWM`` of
    ``/proc/self/status``, else ``getrusage``'s ``ru_maxrss``. Why not ``ru_maxrss`` on Linux: it
    survives ``exec``, so a worker spawned (fork + exec) by a large process — a launcher, a test
    session — starts with that process's resident size as its "peak"; ``VmHWM`` belongs to the
    worker's own address space. The one peak-RSS reading of the package: the trainer's
    ``peak_mem_bytes`` on CPU (:func:`gridshard.engine.metrics.peak_memory_bytes`) and the
    planner's calibration floor read it."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):       # tensor subclasses without a storage
        return None


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of distinct storages saved for backward inside the ``with`` block (the
    pack hook sees each; the unpack hook gives the tensor back unchanged).

    ``exclude``: tensors (typically ``model.parameters()``) whose storages are not counted.
    After the block: ``bytes`` (total), ``entries`` (list of (shape, dtype, storage bytes))."""

    def __init__(self, exclude=()):
        super().__init__(self._pack, lambda t: t)
        self._excluded = {k for k in (_storage_key(t) for t in exclude) if k is not None}
        self._seen: dict = {}

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key is not None and key not in self._excluded and key not in self._seen:
            if key[0] != 0:                                 # empty storages hold nothing
                self._seen[key] = (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return as_saved(t)

    def __enter__(self) -> "SavedTensorMeter":
        super().__enter__()
        return self

    @property
    def entries(self) -> list:
        return list(self._seen.values())

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self._seen.values())


def _tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v)


def _new_bytes(ranges: list, span: tuple) -> int:
    """Bytes of ``span`` = (start, end) not yet in ``ranges`` (disjoint (start, end) pairs), which
    then covers it."""
    start, end = span
    fresh, at = 0, start
    for a, b in sorted(ranges):
        if b <= at or a >= end:
            continue
        fresh += max(0, a - at)
        at = max(at, b)
    fresh += max(0, end - at)
    ranges.append(span)
    return fresh


def model_state_tensor_bytes(model: torch.nn.Module, optimizer=None, extra=()) -> dict:
    """{"params", "grads", "optimizer", "extra"}: bytes of the distinct storages of the model's
    parameters, their ``.grad``, the optimizer's state tensors and ``extra`` tensors (e.g. a
    ZeRO implementation's flat buffers), each storage counted once across all four.

    With a ZeRO reducer (``model.grad_reducer``, :mod:`gridshard.zero.pages`): a buffer it lists
    in ``released_tensors()`` counts 0 (a released mapping keeps its storage's size), and a view
    carved from its ``arena`` counts its own byte range, each byte once (the arena is one storage
    shared by chunks and AdamW moments)."""
    reducer = getattr(model, "grad_reducer", None)
    released = reducer.released_tensors() if hasattr(reducer, "released_tensors") else ()
    seen: set = {k for k in (_storage_key(t) for t in released) if k is not None}
    arena = getattr(reducer, "arena", None)
    carved: list = []                                   # byte ranges of the arena counted so far

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            where = arena.byte_range(t) if arena is not None else None
            if where is not None:
                total += _new_bytes(carved, where)
                continue
            key = _storage_key(t)
            if key is None or key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    out = {"params": count(params), "grads": count(p.grad for p in params if p.grad is not None)}
    out["optimizer"] = count(_tensors_of(list(optimizer.state.values()))) if optimizer is not None else 0
    out["extra"] = count(_tensors_of(list(extra)))
    return out
