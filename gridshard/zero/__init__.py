"""Data-parallel gradient reduction: one reducer for every ZeRO stage (:mod:`.reducer`,
:class:`.data_parallel.ZeroDataParallel`) — ZeRO-0 all-reduces buckets of a persistent flat
gradient buffer in place; stages 1 (optimizer state), 2 (+ gradients) and 3 (+ parameters) shard
by element ranges of each unit's flat buffer (:mod:`.flat_layout`, :mod:`gridshard.theory.zero`)."""
from .data_parallel import ZeroDataParallel, offload_note, warn_offload_on_cpu
from .flat_layout import FlatLayout
from .reducer import SteppedTensor, build_reducer
from ..theory.zero import chunk_range, flat_range_boxes, owned_elements, unit_padded_numel, unit_shard_numel

__all__ = ["FlatLayout", "SteppedTensor", "ZeroDataParallel", "build_reducer", "chunk_range", "flat_range_boxes",
           "offload_note", "owned_elements", "unit_padded_numel", "unit_shard_numel", "warn_offload_on_cpu"]
