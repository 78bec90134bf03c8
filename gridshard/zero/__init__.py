"""ZeRO over the data dimension: optimizer state (1), + gradients (2), + parameters (3)
sharded by rows of each rank's tensor block (:mod:`gridshard.zero.rows`)."""
from .rows import owned_rows, padded_numel, rows_per_rank, shard_numel

__all__ = ["owned_rows", "padded_numel", "rows_per_rank", "shard_numel"]
