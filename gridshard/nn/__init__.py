"""Layers that hold only their local shard, and the per-mode styles the model uses."""
from .sharding import ShardSpec, get_spec, set_spec, shard_from_global, sharded_parameter
from .style import NoTensorParallel, TensorParallelStyle

__all__ = ["ShardSpec", "get_spec", "set_spec", "shard_from_global", "sharded_parameter",
           "NoTensorParallel", "TensorParallelStyle"]
