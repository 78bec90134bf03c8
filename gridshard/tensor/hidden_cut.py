"""How the 2D grid and the 3D cube cut a hidden vector: the one description their shared layers read.

Both modes hold an activation [b, s, h] as a batch block × a hidden block of h/q, and cut a
parameter's hidden dim (a bias, a norm weight, a vision layer's kernel, a small classifier's
weight) further, so that every rank stores its own part of the hidden block:

=================  ===================================  ==========================================
                   2D (q×q grid, :mod:`~.tp2d`)          3D (q×q×q cube, :mod:`~.tp3d`)
=================  ===================================  ==========================================
hidden block       grid column j (``grid_col``)          output coordinate l
sub-block          grid row i: h/q² per rank            (weight, input) = i·q + j: h/q³ per rank
``gather`` axis    ``col`` (q ranks of column j)         ``batch`` (q² ranks of hidden block l)
``reduce`` axis    ``row`` (my rows' q hidden blocks)    ``output`` (my rows' q hidden blocks)
=================  ===================================  ==========================================

The members of ``gather`` hold one hidden block between them, one sub-block each, and one batch
block each (member index = my batch block): all-gathering a parameter over ``gather`` gives the
hidden block, and reduce-scattering its gradient there sums the batch blocks. The members of
``reduce`` hold the other hidden blocks of my rows: a sum over the hidden dim is an all-reduce
there. A vocabulary table ([V_pad, h]) is cut the other way round: vocab block = my ``gather``
member index (V_pad/q in 2D, V_pad/q² in 3D), hidden block as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import check_divisible
from ..nn.sharding import ShardSpec, sharded_parameter


@dataclass(frozen=True)
class HiddenCut:
    """One mesh's cut (module docstring): ``gather`` / ``reduce`` axes, the spec coordinate of the
    hidden ``block`` and those of the sub-block (``members``, outermost first), ``coords`` (index,
    size) dicts the specs' names are read from; and for messages ``shape`` (grid / cube),
    ``rows`` (my batch rows, b/q or b/q²), ``batch_fix`` (how a caller gets them) and ``tag``.
    ``sum_image_grad``: a patch embedding sums its images' gradient over ``reduce`` itself (3D; in 2D
    :func:`gridshard.comm.grid_ops.split_batch`'s backward does)."""

    mesh: object
    gather: object
    reduce: object
    block: str
    members: tuple
    coords: tuple
    shape: str
    rows: str
    batch_fix: str
    tag: str = ""
    sum_image_grad: bool = False

    @property
    def blocks(self) -> int:
        """Blocks the hidden dim is cut into: q² (2D) or q³ (3D)."""
        return self.gather.size * self.mesh.q

    @property
    def power(self) -> str:
        return "q²" if self.gather.size == self.mesh.q else "q³"

    def spec(self, shape, dim: int) -> ShardSpec:
        """A tensor cut on its hidden dim ``dim``: hidden block, then sub-block."""
        return ShardSpec(tuple(shape), ((dim, self.block), *((dim, m) for m in self.members)))

    def table_spec(self, vocab: int, padded: int, hidden: int) -> ShardSpec:
        """A [V_pad, h] table: vocab block = my ``gather`` member index, hidden block as activations."""
        return ShardSpec((padded, hidden), (*((0, m) for m in self.members), (1, self.block)),
                         canonical_shape=(vocab, hidden))

    def parameter(self, spec: ShardSpec, init: Callable[[torch.Tensor], None], dtype, device) -> torch.nn.Parameter:
        return sharded_parameter(spec, self.mesh, init, dtype, device, coords=self.coords)

    def check(self, value: int, what: str, layers: str) -> None:
        """ShapeError unless ``value`` (called ``what``) splits into :attr:`blocks`."""
        check_divisible(value, self.blocks, f"{what} ({layers} splits it into {self.power} blocks)", self.power,
                        f"use {what} a multiple of {self.blocks}")


def normal_init(std: float) -> Callable[[torch.Tensor], None]:
    return lambda full: full.normal_(0.0, std)


def transposed_normal(out_features: int, in_features: int, std: float) -> Callable[[torch.Tensor], None]:
    """Draw [out, in] ~ N(0, std²) (the init contract of :mod:`gridshard.testing.plain`), store [in, out]."""
    def init(full: torch.Tensor) -> None:
        full.copy_(torch.empty(out_features, in_features).normal_(0.0, std).t())
    return init


def padded_table_init(vocab: int, hidden: int, std: float, padded: int, transposed: bool = False):
    """Draw [vocab, hidden] ~ N(0, std²) and append ``padded − vocab`` zero rows; ``transposed``:
    store the [hidden, padded] transpose (an LM head's [in, out] weight)."""
    def init(full: torch.Tensor) -> None:
        table = torch.zeros(padded, hidden)
        table[:vocab].copy_(torch.empty(vocab, hidden).normal_(0.0, std))
        full.copy_(table.t() if transposed else table)
    return init
