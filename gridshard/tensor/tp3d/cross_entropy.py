"""Vocabulary-parallel cross-entropy on a 3D logits layout; never materialises full-vocab logits.

The logits come from :class:`gridshard.tensor.tp3d.linear.VocabParallelClassifier3D` built on a mesh
``M``; they are in ``M.swapped()``'s layout — pass that orientation (``head.out_mesh``) here.
Rank (i, j, l) then holds logits[batch block ``mesh.batch_index`` of q², :, vocab block
``mesh.hidden_index`` of q], [b/q², s, V_pad/q], and the targets of its batch block [b/q², s]
(``mesh.batch_block(targets, hidden=False)``). Columns ≥ ``vocab_size`` are padding, set to −∞.

It is the 2D loss (:mod:`gridshard.tensor.tp2d.cross_entropy`, whose autograd function runs here
unchanged) with ``mesh.output`` (the q vocab blocks of a token) as the row and ``mesh.batch``
(the q² batch blocks, one per member) as the column:

    m = max_output(max_local z),  S = Σ_output Σ_local exp(z − m),  z_t = Σ_output z[target]
    ℓ = log S + m − z_t    (0 where the target is ignore_index; every exp is of z − m ≤ 0, so
                            the loss is exact at |z| = 1e4)
    (Σ_valid ℓ, N, verdicts) all-reduced over ``batch``  → the same scalar on every rank:
    "sum": Σ ℓ;  "mean": Σ ℓ / N (NaN with zero gradient when N = 0, as F.cross_entropy)

Backward is local: dz = (softmax − onehot)·valid·w, w = g (sum) or g/max(N, 1) (mean).
A target outside [0, V) (ignore_index excepted) raises the same error on every rank after the
``batch`` all-reduce (its verdict slots ride along, 2q² float64).

Communication (forward only): 2 all-reduces on ``output`` ([b/q², s] max, [2, b/q², s] fp32),
1 on ``batch`` of (2 + 2q²) float64 (:func:`gridshard.tensor.tp3d.theory.cross_entropy3d_comm`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...mesh import Axis
from ..tp2d.cross_entropy import _CrossEntropy2DFn, check_loss_inputs


@dataclass(frozen=True)
class _LossGrid:
    """The 3D logits layout in the names the 2D loss reads: ``row`` = the vocab-block axis,
    ``col`` = the batch-block axis, ``q`` = the number of batch blocks (verdict slots);
    ``loss_name``: the name a bad target's error gives the loss (this one's, not the 2D one's)."""

    q: int
    row: Axis
    col: Axis
    grid_row: int
    grid_col: int
    loss_name: str = "cross_entropy_3d"       # how the 2D function's errors name this loss


def cross_entropy_3d(logits: torch.Tensor, targets: torch.Tensor, mesh, vocab_size: int,
                     ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every non-ignored target of the cube's micro-batch, the same scalar on
    every rank (module docstring). ``mesh``: the orientation the logits are in (the head's
    ``out_mesh``)."""
    check_loss_inputs("cross_entropy_3d", logits, targets, mesh.q, vocab_size, reduction,
                      "mesh.batch_block(targets, hidden=False) on the head's out_mesh")
    grid = _LossGrid(mesh.q ** 2, mesh.output, mesh.batch, mesh.batch_index, mesh.hidden_index)
    return _CrossEntropy2DFn.apply(logits, targets, grid, vocab_size, ignore_index, reduction)
