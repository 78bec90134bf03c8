"""``2d``: SUMMA on a q×q grid, T = q² (docs/tp2d.md).

Weights and activations are split in both dims: a rank (i, j) holds block (i, j) of every weight,
heads, kv heads and neurons in q column blocks, the rows of batch block i of every micro-batch,
and the hidden state as [m/q, s, h/q].

The mesh. The tensor dim is laid out as a q×q grid,
``T = q²``, and the mesh has shape ``(D, P, q, q)`` with dims
``("data", "pipeline", "grid_row", "grid_col")`` plus the flattened ``"tensor"``
dim. The rank at grid position (i, j) has tensor rank ``t = i*q + j``.

Naming of the 2D groups follows the SUMMA text, not the mesh dim:

* ``row`` axis: the q ranks that share my grid row i (they differ in column j);
  it is the group *along* the mesh dim ``grid_col``. SUMMA broadcasts A's panels
  along it.
* ``col`` axis: the q ranks that share my grid column j (they differ in row i);
  it is the group along ``grid_row``. SUMMA broadcasts B's panels along it.
"""
from __future__ import annotations

import math

from ...errors import LayoutError
from ...mesh import device_axis, shape_axis
from .build import build_2d
from .cross_entropy import cross_entropy_2d
from ...tensor_scheme import DivisibilityRule
from ..base import Scheme
from ...theory.memory import FP32, RankShape
from ...theory.vocab import padded_vocab_size
from .cost import tensor_comm_2d
from ..grid_linear import shared_input_fusion
from .linear import Linear2D


class TwoDScheme(Scheme):
    """SUMMA on a q×q grid: weights and activations split in both dims."""

    key, constant, summary = "2d", "TWO_D", "SUMMA on a q×q grid"

    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        """T = q²."""
        self.check_no_depth(depth)
        if math.isqrt(T) ** 2 != T:
            r = math.isqrt(T)
            lo, hi = max(1, r * r), (r + 1) ** 2
            raise LayoutError(f"tensor={T} is not a perfect square: 2D tensor parallelism lays the T ranks out "
                              f"as a q×q grid, so T must be q². Fix: use tensor={lo} or tensor={hi}, or "
                              f"tensor_mode='1d'.")

    def side(self, T: int) -> int:
        """q = √T."""
        return math.isqrt(T)

    def where(self, T: int) -> str:
        return f"on a q={self.side(T)} grid"

    def head_split(self, T: int) -> int:
        return self.side(T)

    def batch_split(self, T: int) -> int:
        """Grid row i holds batch block i of q."""
        return self.side(T)

    def layout_rules(self, T: int, hidden: int, heads: int, ffn: int, kv_heads: int) -> list:
        q = self.side(T)
        why = "2D splits it into q column blocks"
        split = [DivisibilityRule(what, v, q, "q", why, fix=f"use a grid side q that divides {v}")
                 for what, v in (("heads", heads), ("ffn_hidden", ffn), ("kv_heads", kv_heads))]
        return [DivisibilityRule("hidden", hidden, q * q, "q²", "2D norm weights are stored in q² blocks",
                                 fix=f"use hidden a multiple of {q * q}"), *split]

    def batch_rules(self, T: int, sequence_parallel: bool, batch: int, seq: int) -> list:
        return [DivisibilityRule("micro_batch", batch, self.side(T), "q",
                                 "2D tensor parallelism splits each micro-batch over the q grid rows")]

    def tensor_dims(self, T: int) -> tuple:
        """(grid_row, grid_col) of size q each: the rank at (i, j) has tensor rank i·q + j."""
        q = self.side(T)
        return ("grid_row", q), ("grid_col", q)

    def attach_axes(self, mesh, device_mesh, submesh, ledger) -> list:
        """``q``, the ``row`` axis (my grid row's q ranks, along ``grid_col``) and ``col`` axis (along
        ``grid_row``), my ``grid_row``/``grid_col``, and batch block k·q + i of d·q (2.5D: depth layer k)."""
        mesh.q = self.side(mesh.tensor.size)
        mesh.row = device_axis(device_mesh, "grid_col", "row", ledger)
        mesh.col = device_axis(device_mesh, "grid_row", "col", ledger)
        mesh.grid_row, mesh.grid_col = mesh.col.rank, mesh.row.rank
        assert mesh.tensor.rank == mesh.grid_row * mesh.q + mesh.grid_col
        mesh.batch_blocks = mesh.tensor_depth * mesh.q
        mesh.batch_index = mesh.depth.rank * mesh.q + mesh.grid_row
        return [mesh.row, mesh.col]

    def attach_shape_axes(self, mesh, tensor_rank: int) -> None:
        q = mesh.q = self.side(mesh.tensor.size)
        mesh.grid_row, mesh.grid_col = divmod(tensor_rank, q)
        mesh.row = shape_axis("row", q, mesh.grid_col)
        mesh.col = shape_axis("col", q, mesh.grid_row)
        mesh.batch_blocks, mesh.batch_index = q, mesh.grid_row

    def build_layer(self, name, module, kind: str, build, tied=None):
        """The 2D layer of ``kind`` (:func:`gridshard.tensor.tp2d.build.build_2d`)."""
        return build_2d(name, module, kind, build.mesh, tied_embedding=tied, overlap=build.summa_overlap,
                        vector_cache=build.vector_cache)

    def token_gathers(self, mesh, sequence_parallel: bool) -> tuple:
        """The hidden blocks of my rows (``row``, the last dim), then the batch blocks (``col``, dim 0):
        :func:`gridshard.tensor.tp2d.linear.hidden_cut_2d`'s axes."""
        from .linear import hidden_cut_2d

        cut = hidden_cut_2d(mesh)
        return (cut.reduce, -1), (cut.gather, 0)

    def check_replicated(self, name: str, module, sequence_parallel: bool) -> None:
        build_2d(name, module, "replicate", None)          # raises: the residual stream is split over the grid

    def batch_block_axis(self, mesh):
        """The grid column: the q ranks holding the q batch blocks of one weight column."""
        return mesh.col

    def batch_blocks_name(self, mesh) -> str:
        return "grid side q" if mesh.batch_blocks == mesh.q else "2.5D batch blocks d·q"

    def lm_loss(self, logits, targets, ctx, ignore_index: int, reduction: str):
        """:func:`gridshard.tensor.tp2d.cross_entropy.cross_entropy_2d` over logits [b/q, s, V_p/q] of block (i, j)."""
        return cross_entropy_2d(logits, targets, ctx.mesh, ctx.vocab_size, ignore_index, reduction)

    def rank_shape(self, cfg, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
        """Batch block of q rows, residual over T, heads / neurons / vocabulary over q."""
        self.check_tensor_size(T)
        q = self.side(T)
        return RankShape(tokens // q, tokens * cfg.hidden // T, cfg.heads // q, cfg.kv_heads // q,
                         cfg.ffn_hidden // q, padded_vocab_size(cfg.vocab_size, q) // q)

    def norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, consumer_input: int) -> int:
        return self.grid_norm_saved_bytes(cfg, r, self.side(T), e, consumer_input)

    def layer_norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, pb: int, output_kept: bool) -> int:
        """:meth:`grid_layer_norm_saved_bytes`; SUMMA keeps y's e-byte block (its autocast copy)."""
        return self.grid_layer_norm_saved_bytes(cfg, r, self.side(T), e, pb, r.residual * e if output_kept else 0)

    def image_embedding_saved_bytes(self, cfg, T: int, batch: int, e: int, pb: int) -> int:
        return self.grid_image_embedding_saved_bytes(cfg, batch, self.batch_split(T), self.side(T), e)

    def class_head_saved_bytes(self, cfg, T: int, r: RankShape, batch: int, e: int, pb: int,
                               sequence_parallel: bool = False) -> int:
        return self.grid_class_head_saved_bytes(cfg, r, batch, self.side(T), e, pb)

    def autocast_weight_elements(self, cfg, T: int) -> tuple:
        """Every SUMMA weight block, h/q input rows each."""
        return self._grid_weight_elements(cfg, T, cfg.hidden // self.side(T))

    def head_and_loss_saved_bytes(self, cfg, T: int, r: RankShape, e: int) -> int:
        return self.masked_loss_bytes(r) + FP32

    def bias_rules(self, T: int, width: int) -> list:
        q = self.side(T)
        return [DivisibilityRule("ffn_hidden", width, q * q, "q²",
                                 f"in 2D the MLP's first bias is stored in q²={q * q} blocks",
                                 fix=f"use a multiple of {q * q}")]

    def tensor_comm(self, cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> dict:
        """:func:`gridshard.tensor.tp2d.cost.tensor_comm_2d`: row and column groups share the node's link."""
        return {"tensor": tensor_comm_2d(cfg, layout, seq, layers, first, last, e)} if layout.tensor > 1 else {}

    def gemm_split(self, T: int) -> int:
        """One SUMMA panel step: [N/q, h/q]·[h/q, f/q], so 2·N·h·f/q³."""
        return self.side(T) ** 3

    def shared_input_fusion(self, children):
        """One SUMMA A·B on the joined blocks (:func:`gridshard.tensor.grid_linear.shared_input_fusion`)."""
        return shared_input_fusion(children, Linear2D)
