"""Classifier1D: the class-token classifier of a ViT on the none / 1D layouts.

Input: the final hidden states of this rank, [b, s, h] (the whole sequence; every tensor
rank holds the same) or, under sequence parallelism, the sequence block [b, s/T, h] of
rank t. Output: the full logits [b, K] on every tensor rank, K = num_classes.

Weight [K, h] and bias [K] are **replicated**: K is a handful of classes, so a
column split would leave each rank K/T outputs and need a gather of [b, K] anyway, for
K·h parameters (640 for the digits model); a row split would need the hidden dim split,
which the 1D residual stream is not. Every rank computes the same logits from the same
class-token row, hence the same loss and the same complete gradient: nothing to reduce.

The class token is row 0 of the sequence. Without SP every rank has it. Under SP it lives
in rank 0's block; rather than gathering the whole sequence (b·s·h), each rank
contributes its block's first row and ``gather_from_group`` (forward all-gather of b·T·h
elements along the sequence, backward "take my slice") puts rank 0's first row, the class
token, at position 0 of the gathered [b, T, h] on every rank. Backward: ∂L/∂(that row) is
identical on every rank (replicated weights, same loss), so the slice rule is exact: rank 0
gets the class token's gradient, the other ranks zero for their first rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.dual_ops import gather_from_group
from ...errors import LayoutError
from ...nn.sharding import ShardSpec, set_spec, sequence_parallel_on


class Classifier1D(nn.Module):
    """Class-token classifier, replicated (module docstring): [b, s(/T), h] → [b, K]."""

    def __init__(self, in_features: int, num_classes: int, mesh=None, sequence_parallel: bool = False,
                 bias: bool = True, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and mesh is None:
            raise LayoutError("Classifier1D(sequence_parallel=True) needs the mesh: the class token lives in tensor "
                              "rank 0's sequence block. Fix: pass mesh=<ParallelMesh>.")
        self.in_features, self.num_classes = in_features, num_classes
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        self.axis = mesh.tensor if mesh is not None else None
        self.weight = set_spec(nn.Parameter(torch.empty(num_classes, in_features, dtype=dtype, device=device)),
                               ShardSpec((num_classes, in_features)))
        if bias:
            self.bias = set_spec(nn.Parameter(torch.zeros(num_classes, dtype=dtype, device=device)),
                                 ShardSpec((num_classes,)))
        else:
            self.register_parameter("bias", None)

    def class_token(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h]: row 0 of the whole sequence (module docstring)."""
        if not self.sequence_parallel:
            return x[:, 0]
        return gather_from_group(x[:, :1].contiguous(), self.axis, 1)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cls = self.class_token(x)
        bias = None if self.bias is None else self.bias.to(cls.dtype)
        return F.linear(cls, self.weight.to(cls.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, classes={self.num_classes}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")
