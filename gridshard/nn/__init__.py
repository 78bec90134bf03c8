"""Layers that hold only their local shard, and the per-mode styles the model uses."""
from .sharding import ShardSpec, get_spec, set_spec, shard_from_global, sharded_parameter
from .style import NoTensorParallel, TensorParallelStyle

__all__ = ["ShardSpec", "get_spec", "set_spec", "shard_from_global", "sharded_parameter",
           "NoTensorParallel", "TensorParallelStyle"]


def make_style(mesh, sequence_parallel: bool = False):
    """The style for ``mesh.tensor_mode``: ``none`` → plain layers, ``1d`` → Megatron
    column/row (optionally with sequence parallelism), ``2d`` → SUMMA on the q×q grid."""
    from ..errors import LayoutError

    mode = mesh.tensor_mode
    if mode == "none":
        if sequence_parallel:
            raise LayoutError("sequence_parallel=True needs tensor parallelism: set tensor_mode='1d' and tensor>1.")
        return NoTensorParallel(mesh)
    if mode == "1d":
        from .style_1d import Megatron1DStyle

        return Megatron1DStyle(mesh, sequence_parallel=sequence_parallel)
    if mode == "2d":
        if sequence_parallel:
            raise LayoutError("sequence_parallel=True applies to tensor_mode='1d' only; 2D already splits "
                              "activations over the q×q grid. Fix: set sequence_parallel=false.")
        from .style_2d import Summa2DStyle

        return Summa2DStyle(mesh)
    raise LayoutError(f"unknown tensor_mode={mode!r}")
