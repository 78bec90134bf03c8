"""The peak of the tensor bytes a region allocates and keeps alive: a measurement for benchmarks.

:class:`LiveBytesMeter` is a ``TorchDispatchMode``: every tensor an operator returns inside the
``with`` block is looked at, and a *storage* it has not seen yet is counted (its ``nbytes``) from
that moment until the storage is freed (a ``weakref.finalize`` on the storage's Python object,
which PyTorch keeps for the storage's whole life). ``live`` is the sum over the storages alive now,
``peak`` the largest ``live`` seen. Views share their base's storage and are counted once; an operator's output
whose storage is one of its inputs' (a view, an in-place result) is not new memory, so tensors
made before the block (parameters, inputs) and their views are not counted, nor is memory outside tensors (gloo's
own buffers, the allocator's slack, Python objects).

So around one forward and backward, ``peak`` is the largest sum of activations saved for backward,
transient workspaces (score matrices, ring buffers in flight, collective outputs) and gradients
alive at one instant: what this project calls *peak activation bytes* (docs/context.md, "Memory";
parameter gradients are included, negligible for the tiny-width models it is used on).

Python's cyclic collector is off inside the block (after one collection on entry): a storage held
by a reference cycle is counted until the block ends, not until a collection that allocation
counts, hence earlier work in the process, happen to trigger (two runs of the same step measured
74,176 and 68,032 bytes before).

Dispatch modes are thread-local; on CPU the autograd engine runs backward on the calling thread
with the caller's thread-local state, so backward is seen too. A dispatch mode slows every
operator down: use it in measurements, not in timed runs.
"""
from __future__ import annotations

import gc
import weakref

import torch
from ..torch_private import TorchDispatchMode, tree_flatten


class LiveBytesMeter(TorchDispatchMode):
    """``with LiveBytesMeter() as m: ...`` → ``m.peak`` / ``m.live`` bytes (module docstring)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict = {}
        self._gc_was_enabled = False

    def __enter__(self):
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def _free(self, key) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = (storage.data_ptr(), t.device)
        if key[0] == 0 or key in self._sizes or key in inputs:       # a view of an input: not new memory
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {(s.data_ptr(), t.device) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):              # subclasses without a storage
        return None


__all__ = ["LiveBytesMeter"]
