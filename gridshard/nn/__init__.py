"""Layers that hold only their local shard (1D Megatron and 2D SUMMA families), their
layouts (:mod:`gridshard.nn.sharding`) and the per-mode shape rules
(:mod:`gridshard.nn.shape_rules`). The single-device reference layers they are tested against,
and their initialisation contract, are in :mod:`gridshard.testing.plain`. Models are laid out
with these layers by :func:`gridshard.parallelize`."""
from .sharding import ShardSpec, get_spec, set_spec, shard_from_global, sharded_parameter

__all__ = ["ShardSpec", "get_spec", "set_spec", "shard_from_global", "sharded_parameter"]
