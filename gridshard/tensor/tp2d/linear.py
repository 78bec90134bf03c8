"""Linear2D: y = x·W + b with both x and W split over the q×q grid (SUMMA).

Layout (rank (i, j) = (``mesh.grid_row``, ``mesh.grid_col``)):

* input  x [b, s, in]  → block [b/q, s, in/q]  = x[batch block i, :, in block j];
* weight W [in, out]   → block [in/q, out/q]   = W[in block i, out block j]
  (stored [in, out]; the *global* weight is drawn as [out, in] with
  ``normal_(0, init_std)`` per the init contract of :mod:`gridshard.testing.plain`, then
  transposed, so the same seed gives the same global model as a plain nn.Linear);
* bias   b [out]       → block [out/q²]        = sub-block i of out block j;
* output y [b, s, out] → block [b/q, s, out/q] = y[batch block i, :, out block j].

Forward: the token matrix X [b·s, in] (rows ordered batch-major, so batch block i is
row block i) times W by :func:`gridshard.tensor.tp2d.summa.summa_ab`; the bias is
all-gathered along the column (the q ranks holding out block j) to [out/q] and
added once per output element (the gathered bias is cached until the optimizer
changes the shard: one all-gather per step). Backward (autograd): dX = dY·Wᵀ (SUMMA ABᵀ),
dW = Xᵀ·dY (SUMMA AᵀB), db = reduce-scatter along the column of Σ_tokens dY.

Per rank: parameters (in·out + out)/q² elements; saved for backward the input block
b·s·in/q² elements (the weight block is a parameter). Communication:
:func:`gridshard.tensor.tp2d.theory.linear2d_comm`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ...comm.grid_ops import GatheredVectors, gather_vector
from .summa import summa_ab
from ...errors import ShapeError, check_divisible
from ...nn.precomputed import PrecomputedOutput
from ...nn.sharding import ShardSpec, mesh_coords, sharded_parameter
from ..hidden_cut import HiddenCut, transposed_normal


def weight_spec_2d(in_features: int, out_features: int) -> ShardSpec:
    """[in, out] weight: in split by grid row, out by grid column."""
    return ShardSpec((in_features, out_features), ((0, "grid_row"), (1, "grid_col")), transposed=True)


def bias_spec_2d(out_features: int) -> ShardSpec:
    """[out] vector: out block j (grid column), then its sub-block i (grid row): out/q² per rank."""
    return ShardSpec((out_features,), ((0, "grid_col"), (0, "grid_row")))


def gather_vector_2d(shard: torch.Tensor, mesh, cache=None) -> torch.Tensor:
    """All-gather a :func:`bias_spec_2d` shard [n/q²] along the column → block j [n/q]
    (backward: reduce-scatter of n/q·e).
    Inside an open ``cache`` window (:class:`gridshard.comm.grid_ops.GatheredVectors`, one
    optimizer step) the gathered block is reused: one all-gather per step, not one per forward."""
    return gather_vector(shard, mesh.col, cache)


def hidden_cut_2d(mesh) -> HiddenCut:
    """The grid's :class:`gridshard.tensor.hidden_cut.HiddenCut`: vectors gathered along the column
    (q ranks), hidden sums along the row."""
    return HiddenCut(mesh, mesh.col, mesh.row, "grid_col", ("grid_row",), mesh_coords(mesh), "grid", "b/q",
                     "split_batch")


class Linear2D(nn.Module):
    """2D tensor-parallel linear layer (see the module docstring for the layout).

    ``overlap``: double-buffered async SUMMA broadcasts (False: blocking); ``vector_cache``:
    the model's :class:`gridshard.comm.grid_ops.GatheredVectors` (``parallelize`` passes the
    one of its :class:`gridshard.parallel.model_context.ParallelContext`), so the bias is gathered once
    per cache window; ``None`` gathers it on every forward."""

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, init_std: float = 0.02,
                 weight_init: Optional[Callable[[torch.Tensor], None]] = None,
                 dtype: torch.dtype = torch.float32, device=None, overlap: bool = True,
                 vector_cache: Optional[GatheredVectors] = None):
        super().__init__()
        q = mesh.q
        self.overlap = overlap              # double-buffered async SUMMA broadcasts (False: blocking)
        check_divisible(in_features, q, "in_features", "grid side q")
        check_divisible(out_features, q, "out_features", "grid side q")
        if bias:
            check_divisible(out_features, q * q, "out_features (bias is split into q² blocks)", "q²",
                            f"use out_features a multiple of {q * q} or bias=False")
        self.mesh, self.in_features, self.out_features = mesh, in_features, out_features
        self.in_local, self.out_local = in_features // q, out_features // q
        self.vector_cache = vector_cache    # the model's GatheredVectors (one bias gather per window), or none
        self.precomputed = PrecomputedOutput()    # shared-input parents leave outputs here
        init = weight_init or transposed_normal(out_features, in_features, init_std)
        self.weight = sharded_parameter(weight_spec_2d(in_features, out_features), mesh, init, dtype, device)
        if bias:
            self.bias = sharded_parameter(bias_spec_2d(out_features), mesh, nn.init.zeros_, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.precomputed.take(x)
        if left is not None:
            return left
        if x.shape[-1] != self.in_local:
            raise ShapeError(f"Linear2D({self.in_features}→{self.out_features}) got a local input with last dim "
                             f"{x.shape[-1]}: on a q={self.mesh.q} grid each rank holds in/q = {self.in_local} "
                             f"features. Fix: pass this rank's [b/q, s, in/q] block.")
        y = summa_ab(x.reshape(-1, self.in_local), self.weight, self.mesh, self.overlap)
        y = y.view(*x.shape[:-1], self.out_local)
        if self.bias is not None:
            # in the product's dtype, as F.linear under autocast (an fp32 bias would promote a bf16 y)
            y = y + gather_vector_2d(self.bias, self.mesh, self.vector_cache).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, q={self.mesh.q}, "
                f"bias={self.bias is not None}")
