"""Linear3D: y = x·W + b with x, W and y all split over the q×q×q cube (T = q³).

Layout on a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation (rank (i, j, l) = its weight,
input and output coordinates; N = b·s tokens, batch-major):

* input  x [b, s, in]  → block [b/q², s, in/q]  = x[batch block i·q + j, :, in block l];
* weight W [in, out]   → block [in/q², out/q]   = W[in block l·q + i of q², out block j]
  (stored [in, out]; the global weight is drawn [out, in] ``normal_(0, init_std)`` and
  transposed, the init contract of :mod:`gridshard.testing.plain`);
* bias   b [out]       → block [out/q³]         = sub-block of out block j, indexed i·q + l
  (a vector in the output layout, :func:`vector_spec_3d` on ``mesh.swapped()``);
* output y [b, s, out] → block [b/q², s, out/q] = y[batch block i·q + l, :, out block j]:
  the activation layout of ``mesh.swapped()``, so the next layer is built on the swapped mesh.

Forward: :func:`gridshard.tensor.tp3d.matmul.matmul_3d` (X all-gathered over ``input``, W over
``weight``, the local product reduce-scattered over ``output``); the bias is all-gathered to
out block j over the output layout's ``batch`` axis (q² ranks) and added. Backward (autograd):
dY all-gathered over ``output``, dX = dY·Wᵀ reduce-scattered over ``input``, dW = Xᵀ·dY
reduce-scattered over ``weight``, db = Σ_tokens dY reduce-scattered over the batch axis.

Per rank: parameters (in·out + out)/q³ elements (1/T of the layer); saved for backward the
input block N·in/q³ elements (1/T of one device's). Communication:
:func:`gridshard.tensor.tp3d.theory.linear3d_comm`.

``VocabParallelClassifier3D``: the LM head h → V_pad (no bias; V padded to a multiple of q with
zero rows), logits block [b/q², s, V_pad/q] in the swapped layout, for
:func:`gridshard.tensor.tp3d.cross_entropy.cross_entropy_3d`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...comm.grid_ops import GatheredVectors, gather_vector
from .matmul import matmul_3d, matmul_3d_parts
from ...theory.vocab import padded_vocab_size
from ...nn.sharding import ShardSpec
from ..grid_linear import GridLinear
from ..hidden_cut import HiddenCut, padded_table_init


def weight_spec_3d(in_features: int, out_features: int, mesh, canonical_shape=None) -> ShardSpec:
    """[in, out] weight on ``mesh``: in cut by the output coordinate, then by weight; out by input
    (physical coordinate names, so the swapped orientation's spec names its own axes)."""
    return ShardSpec((in_features, out_features),
                     ((0, mesh.output.name), (0, "weight"), (1, mesh.input.name)), transposed=True,
                     canonical_shape=canonical_shape)


def vector_spec_3d(n: int, mesh) -> ShardSpec:
    """[n] vector of ``mesh``'s activation layout: hidden block = output coordinate, then
    sub-block i·q + j (weight, then input; = ``mesh.batch`` member order): n/q³ per rank."""
    return hidden_cut_3d(mesh).spec((n,), 0)


def hidden_cut_3d(mesh) -> HiddenCut:
    """The cube orientation's :class:`gridshard.tensor.hidden_cut.HiddenCut`: vectors gathered over
    ``batch`` (q² ranks), hidden sums over ``output``."""
    return HiddenCut(mesh, mesh.batch, mesh.output, mesh.output.name, ("weight", mesh.input.name),
                     (mesh.coords(), mesh.sizes()), "cube", "b/q²", "mesh.batch_block(x, hidden=False)",
                     ", swapped" if mesh.is_swapped else "", sum_image_grad=True)


def gather_vector_3d(shard: torch.Tensor, mesh, cache: Optional[GatheredVectors] = None) -> torch.Tensor:
    """A :func:`vector_spec_3d` shard [n/q³] → my hidden block [n/q] (all-gather over
    ``mesh.batch``, n/q·e; backward reduce-scatter of n/q·e, summing the q² batch blocks).
    Inside an open ``cache`` window it is gathered once per window."""
    return gather_vector(shard, mesh.batch, cache)


class Linear3D(GridLinear):
    """3D tensor-parallel linear layer on ``mesh`` (module docstring); its output is in
    ``mesh.swapped()``'s layout (``self.out_mesh``)."""

    shape_name = "cube"
    input_block = "[b/q², s, in/q] block (the previous 3D layer's output, or mesh.batch_block(x))"

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, init_std: float = 0.02,
                 weight_init: Optional[Callable[[torch.Tensor], None]] = None, dtype: torch.dtype = torch.float32,
                 device=None, vector_cache: Optional[GatheredVectors] = None, canonical_shape=None):
        q = mesh.q
        rules = ((q * q, "in_features (Linear3D splits it into q² blocks)", "q²", f"use in_features a multiple of {q * q}"),
                 (q, "out_features", "cube side q"),
                 (q ** 3, "out_features (the bias is split into q³ blocks)", "q³",
                  f"use out_features a multiple of {q ** 3} or bias=False"))
        specs = (weight_spec_3d(in_features, out_features, mesh, canonical_shape),
                 vector_spec_3d(out_features, mesh.swapped()))
        super().__init__(in_features, out_features, mesh, bias, init_std, weight_init, dtype, device, vector_cache,
                         rules, specs, coords=(mesh.coords(), mesh.sizes()))
        self.out_mesh = mesh.swapped()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_3d(x, self.weight, self.mesh)

    def product_parts(self, x: torch.Tensor, weights) -> torch.Tensor:
        """One cube product of the joined weight blocks (:func:`gridshard.tensor.tp3d.matmul.matmul_3d_parts`)."""
        return matmul_3d_parts(x, weights, self.mesh)

    def gathered_bias(self) -> torch.Tensor:
        return gather_vector_3d(self.bias, self.out_mesh, self.vector_cache)


class VocabParallelClassifier3D(Linear3D):
    """LM head h → V_pad (no bias) on ``mesh``: logits block [b/q², s, V_pad/q] in
    ``mesh.swapped()``'s layout; V_pad = ⌈V/q⌉·q, the padding columns are 0 (the 3D loss masks
    them). Canonical weight [V, h], as ``nn.Linear(h, V)``."""

    def __init__(self, hidden: int, vocab: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device=None):
        padded = padded_vocab_size(vocab, mesh.q)
        super().__init__(hidden, padded, mesh, bias=False, dtype=dtype, device=device,
                         weight_init=padded_table_init(vocab, hidden, init_std, padded, transposed=True),
                         canonical_shape=(vocab, hidden))
        self.vocab, self.padded_vocab = vocab, padded
