"""ZeRO over the data dimension: optimizer state (1), + gradients (2), + parameters (3)
sharded by rows of each rank's tensor block (:mod:`gridshard.theory.zero`)."""
from .data_parallel import ZeroDataParallel, offload_note, warn_offload_on_cpu
from ..theory.zero import owned_rows, padded_numel, rows_per_rank, shard_numel

__all__ = ["ZeroDataParallel", "offload_note", "owned_rows", "padded_numel", "rows_per_rank", "shard_numel",
           "warn_offload_on_cpu"]
