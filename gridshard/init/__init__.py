"""Layout-independent parameter initialisation: values are a pure function of
(seed, parameter name, global element index), so each rank materialises only its shard
(see :mod:`gridshard.init.counter_rng`)."""
from .counter_rng import block_flat_indices, fill_normal_, key_hash, normal_at, uniform_at

__all__ = ["key_hash", "uniform_at", "normal_at", "block_flat_indices", "fill_normal_"]
