"""``2.5d``: d depth layers of a q×q grid, T = q²·d (Tesseract; docs/tp2p5d.md).

Depth layer k is a complete 2D grid on batch slice k with the same weights, so the layers, shape
rules, stage boundaries and the memory model are 2D's on q² ranks (:meth:`TwoP5DScheme.layer_layout`),
and the depth joins the data ranks in the gradient reduction.

The mesh. The tensor dim is laid out as d depth layers of a q×q grid: shape ``(D, P, [C,] d, q, q)`` with dims
``("data", "pipeline", ["context",] "depth", "grid_row", "grid_col")``, so

    global_rank = (((d_ * P + p) * C + c) * d + k) * q² + i * q + j     (d_: data index, k: depth layer)

and tensor rank t = k·q² + i·q + j (one depth layer is q² consecutive ranks). Depth layer k is a complete 2D grid on batch slice k of every micro-batch
with the *same* weights, so in training the depth is a data-parallel axis inside the tensor
group: the model sees the mesh as its layer's 2D mesh (``tensor_mode`` 2d, ``tensor`` the
flattened q² grid of my layer, ``q``, ``row``, ``col``), ``depth`` is the d ranks at my grid
position, and the reducer's ``data_context`` is data × context × depth flattened (D·C·d ranks):
the one place where the depth sum of the weight gradients happens in training (ZeRO then shards
over the depth replicas too). ``job_mode`` keeps the config's 2.5d.
"""
from __future__ import annotations

import math

from ...errors import LayoutError
from ...tensor_scheme import DivisibilityRule, tensor_scheme
from ..base import Scheme


class TwoP5DScheme(Scheme):
    """d depth layers of a q×q grid; every per-layer question is 2D's on q² ranks."""

    key, constant, summary = "2.5d", "TWO_P5_D", "d depth layers of a q×q grid"

    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        """T = q²·d with q ≥ 2 and d ≥ 1, naming the valid T for this d."""
        d = depth
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise LayoutError(f"tensor_depth={d!r} is invalid: the 2.5D depth d is an integer >= 1 (d = 1 is 2D). "
                              f"Fix: set parallel.tensor_depth to 1 or more.")
        layer = T // d if T % d == 0 else 0
        q = math.isqrt(layer)
        if q < 2 or q * q != layer:
            valid = ", ".join(str(k * k * d) for k in range(2, 6))
            raise LayoutError(f"tensor={T} with tensor_mode='2.5d' and tensor_depth={d}: 2.5D lays the T ranks out "
                              f"as d={d} depth layers of a q×q grid, so T must be q²·d with q >= 2. Fix: use tensor "
                              f"in ({valid}, ...) for d={d}, or change tensor_depth.")

    def depth_choices(self, T: int) -> tuple:
        return tuple(range(2, T // 4 + 1))

    def layer_layout(self, T: int, depth: int = 1) -> tuple:
        """(2d, T/d): depth layer k is the 2D layout on q² ranks over batch slice k."""
        return tensor_scheme("2d"), T // depth

    def _layer_only(self, what: str):
        raise LayoutError(f"TensorMode('2.5d').{what}: 2.5D rules are 2D's on one depth layer. Fix: call "
                          f"mode.layer_layout(T, depth) first and ask the 2D mode it returns.")

    def side(self, T: int):
        self._layer_only("side")

    def head_split(self, T: int) -> int:
        self._layer_only("head_split")

    def batch_split(self, T: int) -> int:
        self._layer_only("batch_split")

    def boundary_block(self, T: int, sequence_parallel: bool, micro: int, seq: int, hidden: int,
                       depth: int = 1) -> tuple:
        """Depth layer k is the 2D layout on q² ranks over its m/d rows, so [m/(d·q), s, h/q]; grid
        position (k, i, j) sends it to (k, i, j) of the next stage."""
        mode, layer_T = self.layer_layout(T, depth)
        return mode.boundary_block(layer_T, sequence_parallel, micro // depth, seq, hidden)

    def depth_rules(self, T: int, depth: int, micro_batch: int) -> list:
        """Depth layer k takes m/d rows, cut again over its q grid rows: m a multiple of d·q."""
        q = self.layer_layout(T, depth)[0].side(T // depth)
        return [DivisibilityRule("micro_batch", micro_batch, depth * q, "d·q",
                                 f"2.5D with tensor_depth={depth} on a q={q} grid splits each micro-batch into "
                                 f"d·q = {depth * q} row blocks", fix=f"use a multiple of {depth * q}")]
