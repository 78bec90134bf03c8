"""What a reducer's stage, data size and precision decide, once: :class:`ZeroSettings`, read by
the unit layout (:mod:`.units`), the ZeRO-3 gather (:mod:`.gather`), the gradient reduction
(:mod:`.reduction`) and the facade (:class:`~.data_parallel.ZeroDataParallel`), each through
``self.<flag>`` (:class:`ReadsSettings`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..theory.memory.model_state import REDUCTIONS_IN_FLIGHT

MAX_IN_FLIGHT = REDUCTIONS_IN_FLIGHT  # ZeRO ≥ 1: reductions outstanding in backward; the oldest is waited for
                                     # before another is cast and issued (the memory model counts them)


@dataclass(frozen=True)
class ZeroSettings:
    """The flags of one reducer (:meth:`of` derives them; the module docstrings of
    :mod:`.units` and :mod:`.reduction` say what each changes)."""

    stage: int
    param_dtype: torch.dtype          # bf16: fp32 master chunks (gridshard.zero.units)
    mixed: bool                       # parameters stored in another dtype than fp32
    reduce_fp32: bool                 # gradients reduced in fp32
    overlap: bool                     # reductions issued in the backward
    sharded_accumulation: bool        # ZeRO-2/3 with overlap: reduce-scatter every micro-batch
    defer_root: bool                  # a pipeline's tied-embedding copy: the root is reduced in sync()
    fp32_accumulation: bool           # ZeRO-0/1, bf16 storage, overlap: earlier micro-batches into fp32
    persistent: bool                  # a gradient buffer exists (not ZeRO-0 at D = 1 in fp32)
    max_in_flight: Optional[int]      # ZeRO ≥ 1: MAX_IN_FLIGHT

    @classmethod
    def of(cls, stage: int, data_axis, overlap: bool, param_dtype: torch.dtype,
           grad_reduce_dtype: torch.dtype, defer_root: bool) -> "ZeroSettings":
        mixed = param_dtype != torch.float32
        overlap = overlap and data_axis.size > 1
        return cls(stage=stage, param_dtype=param_dtype, mixed=mixed,
                   reduce_fp32=not mixed or grad_reduce_dtype == torch.float32,
                   overlap=overlap,
                   # ZeRO-2/3 with overlap: reduce-scatter every micro-batch into the sharded accumulator
                   sharded_accumulation=stage >= 2 and overlap,
                   defer_root=defer_root,
                   # ZeRO-0/1 under bf16 storage with overlap: add each earlier micro-batch into an fp32 accumulator
                   fp32_accumulation=stage <= 1 and mixed and overlap,
                   # ZeRO-0, D = 1, fp32: nothing to reduce, autograd's own gradients
                   persistent=stage > 0 or data_axis.size > 1 or mixed,
                   max_in_flight=MAX_IN_FLIGHT if stage else None)


class ReadsSettings:
    """``self.stage``, ``self.mixed``, ... of a reducer part are its ``settings``' fields."""

    settings: ZeroSettings

    def __getattr__(self, name: str):
        settings = self.__dict__.get("settings")
        if settings is None or name not in ZeroSettings.__dataclass_fields__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(settings, name)
