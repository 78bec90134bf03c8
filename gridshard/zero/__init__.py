"""Data-parallel gradient reduction, one protocol for every stage (:mod:`.reducer`): ZeRO-0 over a
persistent bucketed gradient buffer (:mod:`.grad_buffer`), and optimizer state (1), + gradients (2),
+ parameters (3) sharded by element ranges of each unit's flat buffer (:mod:`.flat_layout`,
:mod:`gridshard.theory.zero`)."""
from .data_parallel import ZeroDataParallel, offload_note, warn_offload_on_cpu
from .flat_layout import FlatLayout
from .grad_buffer import DataParallelGradSync
from .reducer import GradReducer, SteppedTensor, build_reducer
from ..theory.zero import chunk_range, flat_range_boxes, owned_elements, unit_padded_numel, unit_shard_numel

__all__ = ["DataParallelGradSync", "FlatLayout", "GradReducer", "SteppedTensor", "ZeroDataParallel", "build_reducer",
           "chunk_range", "flat_range_boxes", "offload_note", "owned_elements", "unit_padded_numel", "unit_shard_numel",
           "warn_offload_on_cpu"]
