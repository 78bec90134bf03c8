"""Data-parallel gradient reduction, one protocol for every stage (:mod:`.reducer`): ZeRO-0 over a
persistent bucketed gradient buffer (:mod:`.grad_buffer`), and optimizer state (1), + gradients (2),
+ parameters (3) sharded by rows of each rank's tensor block (:mod:`gridshard.theory.zero`)."""
from .data_parallel import ZeroDataParallel, offload_note, warn_offload_on_cpu
from .grad_buffer import DataParallelGradSync
from .reducer import GradReducer, SteppedTensor, build_reducer
from ..theory.zero import owned_rows, padded_numel, rows_per_rank, shard_numel

__all__ = ["DataParallelGradSync", "GradReducer", "SteppedTensor", "ZeroDataParallel", "build_reducer",
           "offload_note", "owned_rows", "padded_numel", "rows_per_rank", "shard_numel", "warn_offload_on_cpu"]
