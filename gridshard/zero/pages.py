"""ZeRO-3's memory outside glibc's heap on CPU: released flat buffers, one arena, a staging pool
(issue 23). The default for ZeRO-3 on a Linux CPU (``train.zero3_host_memory`` unset or ``pages``,
resolved by :func:`host_pages_in_effect` into the reducer's ``host_pages``); ``heap`` (and every other
stage or device) uses plain tensors everywhere. Measured cost and saving: docs/memory.md.

On CPU PyTorch's tensors come from glibc's ``malloc``; freed heap memory stays resident, and
glibc's dynamic mmap threshold sends blocks below the largest mapped block freed so far (≤ 32 MiB)
to the heap (docs/memory.md "Resident memory on CPU"). ZeRO-3 at D = 4 measured a peak *above*
ZeRO-0's: the layer buffers freed and allocated at every use, the chunks and AdamW moments made
between the activations, and the model's original parameters freed at construction, all in one
fragmented heap. Three owners here take ZeRO-3's own memory out of that heap:

* :class:`FlatPages`: a unit's parameter or gradient buffer, on CPU (Linux) its own private
  anonymous mapping of ⌈n·itemsize / page⌉ pages made once. :meth:`FlatPages.release` is
  ``madvise(MADV_DONTNEED)``: the pages leave the resident set, no ``free``; the next write faults
  them in zero-filled, so a released gradient buffer needs no zeroing and a gather rewrites the
  parameter buffer whole. The storage keeps its size while released; the owner's flag (the
  unit's ``gathered`` / ``grads_live``) says whether it holds memory, and
  :meth:`~gridshard.zero.data_parallel.ZeroDataParallel.released_tensors` tells memory
  accounting to count it 0. Elsewhere the buffer is a plain tensor, released by
  ``untyped_storage().resize_(0)`` and restored by ``resize_(n·itemsize)``.
* :class:`StagingPool`: the transients of the collectives on gloo — the all-gather's send
  buffer and the reduce-scatter's receive buffer (:func:`gridshard.comm.collectives._all_gather_staged`,
  ``_reduce_scatter_flat``'s ``staging``) — as a few resident mappings owned by the reducer and
  reused, never released: ``gathers`` = 2 send slots (a gather and the one prefetched ahead) and
  ``reductions`` = ``MAX_IN_FLIGHT + 1`` receive slots (the outstanding reduce-scatters and the
  one being launched), each ``max_unit_numel · 4`` bytes, so the pool holds

      (gathers + reductions) · ⌈4 · max_u padded_u⌉_page   bytes

  once every slot was used. Allocated by gloo or by ``torch.empty`` they were 12.6 MiB blocks
  (29.5 M-parameter model) going through ``malloc`` 24 times a step, between the activations:
  measured, the heap then grew within one step to twice what it held at any time
  (``mallinfo2``). Released after each use (the previous attempt) they were faulted in and
  zeroed again at every collective; kept resident they are faulted in once.
* :class:`ChunkArena`: every long-lived chunk of the reducer — per unit the parameter chunk
  ``C·s_m`` bytes (under bf16 storage the fp32 master itself), the reduced gradient chunk ``4C``,
  AdamW's two moments ``2·C·s_m`` (``s_m`` the stepped dtype's size: 4 under fp32 and bf16
  storage) — carved, each aligned to 64 bytes, from one anonymous mapping of

      Σ_units ⌈C·s_m⌉₆₄ + ⌈4C⌉₆₄ + 2·⌈C·s_m⌉₆₄   bytes,

  made once when the reducer is built (:meth:`ChunkArena.plan` sums it), before any of them is
  written. The optimizer's state is seeded with the moment views
  (:func:`gridshard.engine.optim.build_optimizer`), so ``torch.optim.AdamW`` never allocates
  them; a checkpoint load copies into them (:func:`gridshard.checkpoint.blocks.ensure_adam_state`
  finds the state there). Memory accounting counts each carved view's own bytes (its byte range
  in the arena) instead of the arena's whole storage (:meth:`ChunkArena.byte_range`).

:func:`heap_trimmer` gives the reducer glibc's ``malloc_trim``, called once after construction
(the original parameters freed there leave the resident set) and as the backward reaches each
of its first layers (:meth:`gridshard.zero.gather.ParameterGather.trim_before_regather`). The
heap then holds only a step's transients (activations, gathered-and-freed scratch), as at
ZeRO-0, and hands the activations the backward frees back while the backward's own gradient
buffers and gathers (outside it) grow: without those trims the step's resident peak was there
(docs/memory.md "ZeRO-3's host pages": 0.81 → about 1.1 of the predicted saving).

Safety: a released parameter buffer reads zeros instead of raising, so a missing gather
changes the loss, which the exactness tests (ZeRO-3 against one process) catch.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Callable, Optional

import torch

ALIGN = 64


def mappable(device) -> bool:
    return torch.device(device).type == "cpu" and sys.platform.startswith("linux")


def pages_act(stage: int, device) -> bool:
    """Where host pages change anything: ZeRO-3 (the only stage with released buffers) on a Linux
    CPU (:func:`mappable`; CUDA has its caching allocator)."""
    return stage == 3 and mappable(device)


def host_pages_in_effect(setting: Optional[str], stage: int, device) -> bool:
    """``train.zero3_host_memory`` resolved, once, for a reducer of ``stage`` on ``device``:
    ``None`` (the default) → pages wherever they act (:func:`pages_act`), heap elsewhere, silently;
    ``"pages"`` → the same (where they do not act the composer warns once, :func:`host_pages_note`;
    below ZeRO-3 the config is refused before this); ``"heap"`` → never. Every composition that
    runs ZeRO-3 on CPU takes pages (``train.offload=optimizer`` acts on CUDA only, where pages do
    not)."""
    return setting != "heap" and pages_act(stage, device)


def _anonymous(nbytes: int) -> tuple:
    """(mapping, uint8 tensor over it) of ``nbytes`` rounded up to whole pages."""
    size = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, torch.frombuffer(m, dtype=torch.uint8, count=size)


class FlatPages:
    """A flat buffer of ``numel`` elements of ``dtype`` on ``device`` (``tensor``) whose memory
    :meth:`release` hands back and :meth:`restore` takes again (module docstring). ``mapped``:
    its own anonymous mapping (asked for, on CPU, on Linux); else a storage that is resized."""

    def __init__(self, numel: int, dtype: torch.dtype, device, mapped: bool = True):
        self.nbytes = numel * dtype.itemsize
        self.mapped = mapped and mappable(device) and numel > 0
        self._map: Optional[mmap.mmap] = None
        if self.mapped:
            self._map, self._raw = _anonymous(self.nbytes)
            self.tensor = self._raw[:self.nbytes].view(dtype)
        else:
            self.tensor = torch.zeros(numel, dtype=dtype, device=device)

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The mapping's bytes as a flat tensor of ``dtype`` (a staging buffer of another dtype)."""
        return self._raw[:self.nbytes // dtype.itemsize * dtype.itemsize].view(dtype)

    def release(self) -> None:
        """The buffer's memory leaves the process; its values are gone (zeros when mapped)."""
        if self.mapped:
            self._map.madvise(mmap.MADV_DONTNEED)
        else:
            self.tensor.untyped_storage().resize_(0)

    def restore(self, zero: bool = False) -> None:
        """The buffer can be written again; ``zero``: its values are 0 (a released mapping already is)."""
        if not self.mapped:
            self.tensor.untyped_storage().resize_(self.nbytes)
            if zero:
                self.tensor.zero_()


class ChunkArena:
    """One anonymous mapping of ``nbytes`` carved by :meth:`take` into 64-byte aligned views
    (module docstring); ``None`` from :meth:`on` where the device is not a Linux CPU."""

    def __init__(self, nbytes: int):
        self._map, self._raw = _anonymous(nbytes)
        self.used = 0

    @staticmethod
    def aligned(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    @classmethod
    def plan(cls, pieces) -> int:
        """Bytes an arena needs for ``pieces``, (numel, dtype) pairs, each aligned."""
        return sum(cls.aligned(n * dtype.itemsize) for n, dtype in pieces)

    @classmethod
    def on(cls, device, pieces) -> Optional["ChunkArena"]:
        return cls(cls.plan(pieces)) if mappable(device) and pieces else None

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``dtype`` (zeros: the mapping is fresh)."""
        n = numel * dtype.itemsize
        if self.used + n > self._raw.numel():
            raise RuntimeError(f"ChunkArena: {n} more bytes asked at {self.used} of {self._raw.numel()}. "
                               "Fix: plan() must list every piece take() is asked for")
        view = self._raw[self.used:self.used + n].view(dtype)
        self.used += self.aligned(n)
        return view

    def byte_range(self, t: torch.Tensor) -> Optional[tuple]:
        """(start, end) bytes of ``t`` inside the arena, or None when ``t`` is not carved from it."""
        try:
            if t.untyped_storage().data_ptr() != self._raw.untyped_storage().data_ptr():
                return None
        except (RuntimeError, NotImplementedError):
            return None
        start = t.data_ptr() - self._raw.data_ptr()
        return start, start + t.numel() * t.element_size()


class StagingPool:
    """Resident staging slots for a reducer's gloo collectives (module docstring): ``gathers``
    send slots and ``reductions`` receive slots of ``nbytes`` each, own mappings made on first
    use and kept. :meth:`take` hands a free slot (``None`` when all are in use: the collective
    then allocates its own, correct but in the heap); :meth:`give` returns it. Owned by one
    reducer, freed with it."""

    def __init__(self, nbytes: int, device, gathers: int, reductions: int):
        self.nbytes, self.device = nbytes, device
        self.free = {"gather": list(range(gathers)), "reduce": list(range(reductions))}
        self._slots: dict = {}                                       # (kind, index) → FlatPages

    def nbytes_held(self) -> int:
        """Bytes of the slots made so far (each ⌈nbytes⌉ to whole pages)."""
        return sum(p.tensor.untyped_storage().nbytes() for p in self._slots.values())

    def take(self, kind: str) -> Optional[tuple]:
        """(kind, index) of a free slot of ``kind`` ("gather" | "reduce"), or None."""
        return (kind, self.free[kind].pop()) if self.free[kind] else None

    def view(self, slot: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The slot's bytes as a flat tensor of ``dtype`` (made on first use)."""
        if slot not in self._slots:
            self._slots[slot] = FlatPages(self.nbytes, torch.uint8, self.device)
        return self._slots[slot].as_dtype(dtype)

    def give(self, slot: Optional[tuple]) -> None:
        """``slot`` is free again (its memory stays resident for the next collective)."""
        if slot is not None:
            self.free[slot[0]].append(slot[1])


def host_pages_note(device) -> str:
    """The warning for ``train.zero3_host_memory: pages`` where it changes nothing (not a Linux CPU)."""
    return (f"train.zero3_host_memory=pages: this run is on {torch.device(device).type} "
            f"({sys.platform}); host pages act on a Linux CPU only (glibc's heap), so the setting changes "
            "nothing here. Fix: leave the key unset (or heap)")


def heap_trimmer(device) -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim`` for a run on ``device`` CPU under glibc (module docstring), else None."""
    if not mappable(device):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):                # not glibc (e.g. musl)
        return None
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim


class StagingSlots:
    """What a reducer part that stages collectives does with ``self.staging`` — a
    :class:`StagingPool` or None (host pages off, or D = 1: every collective allocates its own)."""

    staging: Optional[StagingPool]

    def _take_slot(self, kind: str) -> Optional[tuple]:
        """A free slot of the staging pool (host pages at D > 1), else None: the collective allocates."""
        return self.staging.take(kind) if self.staging is not None else None

    def _slot_view(self, slot: Optional[tuple], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The slot's bytes as a flat ``dtype`` tensor; None for no slot (the collective allocates)."""
        return self.staging.view(slot, dtype) if slot is not None else None

    def _give_slot(self, slot: Optional[tuple]) -> None:
        if slot is not None:
            self.staging.give(slot)
