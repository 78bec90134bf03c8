"""Rebuildable saved tensors: drop a tensor a matmul keeps for backward when it is a cheap
pointwise function of tensors that are kept anyway, and compute it again when backward asks.

Part of ``train.recompute: selective`` (:mod:`gridshard.parallel.recompute`), as torchtitan's
op-level selective checkpointing keeps matmul outputs and recomputes pointwise ops. In a
decoder layer two such tensors are kept by a consumer matmul for its weight gradient
(dW = gᵀ·y needs the input y):

1. each RMSNorm's output, kept by q|k|v and gate|up (1D + SP: the sequence block the column
   product keeps and re-gathers in backward; 2D: the block SUMMA keeps)::

       fp32:      y = x̂ · w,                   x̂ = x·rstd kept by the norm's own backward (mul by w)
       bf16/fp16: y = (x_f · rstd · w_f) in x's dtype,   x and rstd kept by the norm's backward
       2D:        y = (x_f · r · w) in x's dtype,       x, r and the gathered w block kept likewise

2. the SwiGLU product p = silu(g) · u, kept by down_proj; g and u are kept anyway, by the
   SwiGLU itself (:func:`gridshard.nn.swiglu.swiglu`, which rebuilds silu(g) from g).

No matmul and no collective is computed again: the recipes are one or two pointwise ops on
tensors already saved, so the bytes dropped per layer are 2·(norm output) + p, and backward
pays those pointwise ops once per tensor: consumers that saved the same output (q, k, v as three
``F.linear`` without tensor parallelism) share one rebuild, held from the first of their
backwards to the last (:class:`_Recipe`).

Mechanism (``torch.autograd.graph.saved_tensors_hooks``). A :class:`RebuildRegion` is opened
around a decoder layer's call (:func:`gridshard.parallel.recompute.rebuild_module`). Inside it

* a producer *offers* its output with a recipe (:meth:`RebuildRegion.offer`: the function and
  the kept tensors it reads, plus the autocast state it ran under);
* the pack hook recognises a tensor whose storage is that of an offered output (same storage
  address, dtype and storage size; the offered output still alive, so an address reused after
  it was freed is never mistaken for it) and stores a :class:`_Rebuild` instead: the recipe
  and the view (size, stride, offset) the consumer saved;
* the unpack hook runs the recipe under the recorded autocast state with gradients off — the
  same ops on the same dtypes as the forward, so the rebuilt tensor is the forward's bit for
  bit (``tests/test_rebuild.py``) — and returns the same view of it.

Every other tensor is handed to the hooks that were active when the region opened (the
saved-tensor meter, a pipeline stage's meter) or kept as is: the region is transparent to them
(only the innermost ``saved_tensors_hooks`` run, so the region reads the outer pair with
:func:`gridshard.torch_private.outer_saved_hooks`, as torch's AOT autograd does, and calls
it itself).
A consumer that saves a *copy* (autocast casting y to another dtype) has another storage: it is
not recognised and nothing is dropped. Under ``torch.compile`` nothing is offered (Dynamo does
not see the offer; the compiled graph chooses its own saved tensors): the hooks pass everything
through. The recipe holds references to its inputs, which the producer's backward keeps anyway
until after the consumer's backward (the consumer is later in the forward); under ZeRO-3 the
norm weight w is the gathered parameter, gathered again before anything of the layer's
backward runs (:mod:`gridshard.zero.data_parallel`), as the norm's own backward needs it.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from ..torch_private import outer_saved_hooks
from .saved import as_saved


class _Recipe:
    """An offered output: ``fn(*inputs)`` under ``autocast`` (device, enabled, dtype) gives it with
    ``stride``. Consumers that saved it share one rebuild per backward: the first unpack computes
    it and, while other packs of it are still to be unpacked, keeps it for them (q, k and v saving
    the same norm output without tensor parallelism: one rebuild, not three)."""

    __slots__ = ("fn", "inputs", "autocast", "stride", "dtype", "nbytes", "pending", "cached")

    def __init__(self, fn, inputs, autocast, stride, dtype, nbytes):
        self.fn, self.inputs, self.autocast, self.stride = fn, inputs, autocast, stride
        self.dtype, self.nbytes, self.pending, self.cached = dtype, nbytes, 0, None

    def base(self) -> torch.Tensor:
        out = self.cached
        if out is None:
            device, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = self.fn(*self.inputs)
            if out.stride() != self.stride:
                raise RuntimeError(f"rebuild: the recipe {getattr(self.fn, '__name__', self.fn)} gave strides "
                                   f"{out.stride()}, the forward's output had {self.stride}.")
        self.pending -= 1
        self.cached = out if self.pending > 0 else None
        return out


class _Rebuild:
    """What the pack hook stores instead of a recognised tensor: the recipe and the saved view."""

    __slots__ = ("recipe", "view")

    def __init__(self, recipe: _Recipe, view):
        self.recipe, self.view = recipe, view
        recipe.pending += 1

    def build(self) -> torch.Tensor:
        size, stride, offset = self.view
        return self.recipe.base().as_strided(size, stride, offset)


def _storage(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):     # tensor subclasses without a storage
        return None


class RebuildRegion:
    """The rebuildable outputs of one module's call (module docstring). :meth:`open` /
    :meth:`close` bracket the call; producers call :meth:`offer`. Calls may nest (each
    :meth:`open` pushes its own frame and hooks)."""

    def __init__(self):
        self._frames: list = []                     # per open call: {storage address: (weakref, recipe)}
        self._hooks: list = []

    def accepting(self) -> bool:
        """An offer would be taken: a call is open, autograd records, not inside a compiled graph."""
        return bool(self._frames) and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def offer(self, out: torch.Tensor, fn: Callable, *inputs: torch.Tensor) -> None:
        """``out`` = ``fn(*inputs)`` bit for bit under the current autocast state: a consumer that
        saves ``out`` (or a view of it) keeps the recipe instead. Taken only for an output that
        covers its whole storage from offset 0 (a fresh result, the case of every producer here)."""
        if not self._frames or torch.compiler.is_compiling():       # (inside autograd.Function.forward grad is off)
            return
        key = _storage(out)
        if key is None or out.storage_offset() != 0 or key[1] != out.numel() * out.element_size():
            return
        dev = out.device.type
        autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self._frames[-1][key[0]] = (weakref.ref(out), _Recipe(fn, inputs, autocast, out.stride(), out.dtype, key[1]))

    def _match(self, t: torch.Tensor) -> Optional[_Rebuild]:
        key = _storage(t)
        entry = self._frames[-1].get(key[0]) if key is not None and self._frames else None
        if entry is None or entry[0]() is None:
            return None
        recipe = entry[1]
        if t.dtype != recipe.dtype or key[1] != recipe.nbytes:
            return None
        return _Rebuild(recipe, (tuple(t.shape), t.stride(), t.storage_offset()))

    def open(self) -> None:
        """Start a call: offers are taken and the pack hook recognises them until :meth:`close`."""
        outer = outer_saved_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            rebuilt = self._match(t)
            if rebuilt is not None:
                return rebuilt
            return as_saved(t) if outer_pack is None else outer_pack(t)

        def unpack(p):
            if isinstance(p, _Rebuild):
                return p.build()
            return p if outer_unpack is None else outer_unpack(p)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._frames.append({})
        self._hooks.append(hooks)

    def close(self) -> None:
        """End the innermost call: its offers are forgotten (what was packed keeps its recipe)."""
        if self._hooks:
            self._frames.pop()
            self._hooks.pop().__exit__(None, None, None)


def offer_to(region: Optional[RebuildRegion], out: torch.Tensor, fn: Callable, *inputs) -> torch.Tensor:
    """``region.offer(out, fn, *inputs)`` when there is a region; returns ``out``."""
    if region is not None:
        region.offer(out, fn, *inputs)
    return out


__all__ = ["RebuildRegion", "offer_to"]
