"""The linear layer a grid (2D, SUMMA) and a cube (3D) share: y = x·W + b with x, W and y split
over the mode's mesh.

Everything but the product and the bias gather is the same in both modes:

* the size rules (in, out and, with a bias, out again: each a :func:`gridshard.errors.check_divisible`);
* the weight and bias parameters, made from the mode's :class:`gridshard.nn.sharding.ShardSpec`;
* the local-input check (each rank holds in/q input features in both modes);
* the bias add, in the product's dtype as ``F.linear`` under autocast (an fp32 bias would
  promote a bf16 y);
* the shared-input slot (:mod:`gridshard.nn.precomputed`) and the shared-input product itself
  (:func:`shared_input_fusion`: q|k|v or gate|up as one product of the joined weight blocks).

A mode's subclass (:class:`gridshard.tensor.tp2d.linear.Linear2D`,
:class:`gridshard.tensor.tp3d.linear.Linear3D`) gives the product (alone and of several weights
read from one input) and the bias gather, and names its mesh and local input block for the error text.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ShapeError, check_divisible
from ..nn.precomputed import PrecomputedOutput
from ..nn.sharding import sharded_parameter
from .hidden_cut import transposed_normal


class GridLinear(nn.Module):
    """``rules``: (in rule, out rule, bias rule), each the (divisor, what, by[, fix]) of a
    :func:`check_divisible` (the bias rule is checked only with a bias); ``specs``: the weight's and
    the bias's :class:`ShardSpec`; ``coords``: as :func:`sharded_parameter`'s. The global weight is
    ``weight_init`` or drawn [out, in] ``normal_(0, init_std)`` and transposed (the init contract of
    :mod:`gridshard.testing.plain`). A subclass defines ``product(x)`` (the local token rows
    [N_local, in/q] times the weight → [N_local, out/q]), ``product_parts(x, weights)`` (the same rows
    times several layers' weight blocks side by side → [N_local, Σ out_k/q], communicating as one
    product of the joined width) and ``gathered_bias()`` (this rank's output block of the bias,
    [out/q])."""

    shape_name = ""      # "grid" or "cube", for the local-input error
    input_block = ""     # this rank's input block, for the same error

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool, init_std: float, weight_init,
                 dtype, device, vector_cache, rules, specs, coords=None):
        super().__init__()
        for value, rule in zip((in_features, out_features, out_features), rules[:3 if bias else 2]):
            check_divisible(value, *rule)
        self.mesh, self.in_features, self.out_features = mesh, in_features, out_features
        self.in_local, self.out_local = in_features // mesh.q, out_features // mesh.q
        self.vector_cache = vector_cache    # the model's GatheredVectors (one bias gather per window), or none
        self.precomputed = PrecomputedOutput()    # shared-input parents leave outputs here
        init = weight_init or transposed_normal(out_features, in_features, init_std)
        self.weight = sharded_parameter(specs[0], mesh, init, dtype, device, coords=coords)
        if bias:
            self.bias = sharded_parameter(specs[1], mesh, nn.init.zeros_, dtype, device, coords=coords)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.precomputed.take(x)
        if left is not None:
            return left
        if x.shape[-1] != self.in_local:
            raise ShapeError(f"{type(self).__name__}({self.in_features}→{self.out_features}) got a local input with "
                             f"last dim {x.shape[-1]}: on a q={self.mesh.q} {self.shape_name} each rank holds in/q = "
                             f"{self.in_local} features. Fix: pass this rank's {self.input_block}.")
        return self.output_bias(self.product(x.reshape(-1, self.in_local)).view(*x.shape[:-1], self.out_local))

    def output_bias(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the gathered bias in y's dtype (none: y contiguous, as models ``view`` it into heads)."""
        return y.contiguous() if self.bias is None else y + self.gathered_bias().to(y.dtype)

    def extra_repr(self) -> str:
        swapped = ", swapped" if getattr(self.mesh, "is_swapped", False) else ""
        return f"in={self.in_features}, out={self.out_features}, q={self.mesh.q}, bias={self.bias is not None}{swapped}"


def shared_input_fusion(children, layer_type):
    """(prepare, compute, input width) that computes ``children`` (q|k|v or gate|up, all exactly
    ``layer_type`` on one mesh orientation, reading one input; :mod:`gridshard.parallel.shared_input`)
    as one ``product_parts`` of their weight blocks side by side, each part's bias added to its
    slice; else None. The grid's (2D, SUMMA) and the cube's (3D) input is already the rank's block:
    nothing to prepare."""
    first = children[0]
    orientation = getattr(first.mesh, "is_swapped", False)
    if any(type(c) is not layer_type or c.in_features != first.in_features
           or getattr(c.mesh, "is_swapped", False) != orientation for c in children):
        return None
    return _input_as_is, _joined_product, first.in_local


def _input_as_is(children, x):
    return x


def _joined_product(children, x):
    first = children[0]
    y = first.product_parts(x.reshape(-1, first.in_local), [c.weight for c in children])
    y = y.view(*x.shape[:-1], y.shape[-1])
    return [c.output_bias(o) for o, c in zip(y.split([c.out_local for c in children], -1), children)]
