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

from ...comm.grid_ops import GatheredVectors, gather_vector
from .summa import summa_ab, summa_ab_parts
from ...nn.sharding import ShardSpec, mesh_coords
from ..grid_linear import GridLinear
from ..hidden_cut import HiddenCut


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


class Linear2D(GridLinear):
    """2D tensor-parallel linear layer (see the module docstring for the layout).

    ``overlap``: double-buffered async SUMMA broadcasts (False: blocking); ``vector_cache``:
    the model's :class:`gridshard.comm.grid_ops.GatheredVectors` (``parallelize`` passes the
    one of its :class:`gridshard.parallel.model_context.ParallelContext`), so the bias is gathered once
    per cache window; ``None`` gathers it on every forward."""

    shape_name, input_block = "grid", "[b/q, s, in/q] block"

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, init_std: float = 0.02,
                 weight_init: Optional[Callable[[torch.Tensor], None]] = None,
                 dtype: torch.dtype = torch.float32, device=None, overlap: bool = True,
                 vector_cache: Optional[GatheredVectors] = None):
        q = mesh.q
        rules = ((q, "in_features", "grid side q"), (q, "out_features", "grid side q"),
                 (q * q, "out_features (bias is split into q² blocks)", "q²",
                  f"use out_features a multiple of {q * q} or bias=False"))
        super().__init__(in_features, out_features, mesh, bias, init_std, weight_init, dtype, device, vector_cache,
                         rules, (weight_spec_2d(in_features, out_features), bias_spec_2d(out_features)))
        self.overlap = overlap              # double-buffered async SUMMA broadcasts (False: blocking)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return summa_ab(x, self.weight, self.mesh, self.overlap)

    def product_parts(self, x: torch.Tensor, weights) -> torch.Tensor:
        """One SUMMA A·B with B = [W_0 | W_1 | …]: column j of the grid holds block j of every part."""
        return summa_ab_parts(x, weights, self.mesh, self.overlap)

    def gathered_bias(self) -> torch.Tensor:
        return gather_vector_2d(self.bias, self.mesh, self.vector_cache)
