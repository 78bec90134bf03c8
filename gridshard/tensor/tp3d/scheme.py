"""``3d``: the T = q³ ranks as a q×q×q cube (docs/tp3d.md).

Every weight is split q³ ways; an activation [b, s, h] is held as [b/q², s, h/q]: tokens of batch
block i·q + j, logits (and so targets) of block i·q + l (the swapped orientation), heads, kv heads
and neurons over q.

The mesh. The tensor dim is laid out as a q×q×q cube:
shape ``(D, P, [C,] q, q, q)`` with dims ``("data", "pipeline", ["context",] "weight", "input",
"output")``, the order :mod:`gridshard.tensor.tp3d.mesh` argues for (the two activation dims innermost,
one block of q² consecutive ranks), so

    global_rank = ((d_ * P + p) * C + c) * q³ + (i * q + j) * q + l     (i, j, l: weight, input, output)

and tensor rank t = (i·q + j)·q + l. ``tensor`` is the flattened cube; the model-facing object is
``mesh.cube``, a :class:`Mesh3D` over the job mesh's three sub-dims in the
residual stream's orientation (built once with the mesh: its two flattened groups are made here,
never per call). Every 3D weight is split q³ ways (no tensor-axis replicas), so the reducer's
``data_context`` is data [× context] as in 1D. The residual stream's batch block is i·q + j of
q² (``batch_index``); the LM head's logits come out in the swapped orientation, batch block
i·q + l (``logits_batch_index``), which is therefore the block of the targets.
"""
from __future__ import annotations

from ...errors import LayoutError
from .mesh import CUBE_DIMS, Mesh3D
from .build import build_3d
from ..grid_linear import shared_input_fusion
from .linear import Linear3D
from .cross_entropy import cross_entropy_3d
from .vision import classification_loss_3d
from ...tensor_scheme import DivisibilityRule
from ..base import Scheme
from ...theory.memory import FP32, RankShape
from ...theory.vocab import padded_vocab_size
from .cost import cube_axis_levels, tensor_comm_3d


def icbrt(n: int) -> int:
    """⌊∛n⌋ for n ≥ 0, exactly (no float rounding)."""
    q = round(n ** (1.0 / 3.0)) if n > 0 else 0
    while q ** 3 > n:
        q -= 1
    while (q + 1) ** 3 <= n:
        q += 1
    return q


class ThreeDScheme(Scheme):
    """3D on a q×q×q cube: every weight split q³ ways, an activation [b, s, h] held as [b/q², s, h/q]."""

    key, constant, summary = "3d", "THREE_D", "a q×q×q cube"

    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        """T = q³ with q ≥ 2."""
        self.check_no_depth(depth)
        q = icbrt(T)
        if q < 2 or q ** 3 != T:
            lo = max(2, q) ** 3 if q ** 3 < T else None
            near = ", ".join(str(k ** 3) for k in range(2, 6))
            raise LayoutError(f"tensor={T} with tensor_mode='3d': 3D lays the T ranks out as a q×q×q cube, so T "
                              f"must be q³ with q >= 2 (valid: {near}, ...). Fix: use tensor={lo or 8}, or "
                              f"tensor_mode='1d' / '2d'.")

    def side(self, T: int) -> int:
        """q = ∛T."""
        return icbrt(T)

    def where(self, T: int) -> str:
        return f"on a q={self.side(T)} cube"

    def head_split(self, T: int) -> int:
        return self.side(T)

    def batch_split(self, T: int) -> int:
        """Batch block i·q + j of q² on rank (i, j, l)."""
        return self.side(T) ** 2

    def layout_rules(self, T: int, hidden: int, heads: int, ffn: int, kv_heads: int) -> list:
        q = self.side(T)
        return [DivisibilityRule("hidden", hidden, q ** 3, "q³", "3D norm weights are stored in q³ blocks",
                                 fix=f"use hidden a multiple of {q ** 3}"),
                DivisibilityRule("heads", heads, q, "q", "3D gives every rank 1/q of the heads",
                                 fix=f"use a cube side q that divides {heads}"),
                DivisibilityRule("ffn_hidden", ffn, q * q, "q²", "3D splits the down projection's input into q² "
                                 "blocks", fix=f"use ffn_hidden a multiple of {q * q}"),
                DivisibilityRule("kv_heads", kv_heads, q, "q", "3D gives every rank 1/q of the kv heads",
                                 fix=f"use a cube side q that divides {kv_heads}")]

    def batch_rules(self, T: int, sequence_parallel: bool, batch: int, seq: int) -> list:
        return [DivisibilityRule("micro_batch", batch, self.side(T) ** 2, "q²",
                                 "3D tensor parallelism splits each micro-batch into q² batch blocks")]

    def tensor_dims(self, T: int) -> tuple:
        """(weight, input, output) of size q each: tensor rank t = (i·q + j)·q + l."""
        q = self.side(T)
        return tuple((name, q) for name in CUBE_DIMS)

    def tensor_submesh(self, device_mesh):
        """The cube's :class:`Mesh3D` (its two flattened groups are made here, once per device mesh)."""
        return Mesh3D.from_device_mesh(device_mesh)

    def attach_axes(self, mesh, device_mesh, submesh, ledger) -> list:
        cube = submesh.with_ledger(ledger)
        _set_cube(mesh, cube)
        return list(cube.physical.values())

    def attach_shape_axes(self, mesh, tensor_rank: int) -> None:
        _set_cube(mesh, Mesh3D.of_shape(self.side(mesh.tensor.size), tensor_rank))

    def logits_batch_index(self, mesh) -> int:
        """i·q + l: the head writes its logits in the swapped orientation."""
        return mesh.cube.swapped().batch_index

    def build_layer(self, name, module, kind: str, build, tied=None):
        """The 3D layer of ``kind`` on the residual orientation ``mesh.cube`` (:func:`gridshard.tensor.tp3d.build.build_3d`)."""
        return build_3d(name, module, kind, build.mesh.cube, tied_embedding=tied, vector_cache=build.vector_cache)

    def shared_input_fusion(self, children):
        """q|k|v (gate|up) as one cube product of the joined weight blocks: the input gathered once
        (:func:`gridshard.tensor.tp3d.matmul.matmul_3d_parts`)."""
        return shared_input_fusion(children, Linear3D)

    def token_gathers(self, mesh, sequence_parallel: bool) -> tuple:
        """On the residual orientation: the hidden blocks of my rows (``output``, the last dim), then the
        batch blocks (``batch``, q² ranks, dim 0): :func:`gridshard.tensor.tp3d.linear.hidden_cut_3d`'s axes."""
        from .linear import hidden_cut_3d

        cut = hidden_cut_3d(mesh.cube)
        return (cut.reduce, -1), (cut.gather, 0)

    def check_replicated(self, name: str, module, sequence_parallel: bool) -> None:
        build_3d(name, module, "replicate", None)          # raises: the residual stream is split over the cube

    def batch_block_axis(self, mesh):
        """The cube's ``batch`` axis (the q² ranks holding one hidden block, one per batch block)."""
        return mesh.cube.batch

    def batch_blocks_name(self, mesh) -> str:
        return "3D batch blocks q²"

    def lm_loss(self, logits, targets, ctx, ignore_index: int, reduction: str):
        """:func:`gridshard.tensor.tp3d.cross_entropy.cross_entropy_3d` on the head's swapped orientation."""
        return cross_entropy_3d(logits, targets, ctx.mesh.cube.swapped(), ctx.vocab_size, ignore_index, reduction)

    def classification_loss(self, logits, labels, mesh, ignore_index: int, reduction: str):
        """:func:`gridshard.tensor.tp3d.vision.classification_loss_3d` on the classifier's (residual) orientation."""
        return classification_loss_3d(logits, labels, mesh.cube, ignore_index, reduction)

    def rank_shape(self, cfg, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
        """Batch block of q², residual over T, heads / neurons / vocabulary over q (a tied head keeps
        the embedding's padding, ⌈V/q²⌉·q²)."""
        q = self.side(T)
        vp = padded_vocab_size(cfg.vocab_size, q * q if getattr(cfg, "tie_embeddings", False) else q)
        return RankShape(tokens // (q * q), tokens * cfg.hidden // T, cfg.heads // q, cfg.kv_heads // q,
                         cfg.ffn_hidden // q, vp // q)

    def norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, consumer_input: int) -> int:
        return self.grid_norm_saved_bytes(cfg, r, self.side(T), e, consumer_input)

    def layer_norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, pb: int, output_kept: bool) -> int:
        """2D's, with y kept as the norm computes it (the 3D product keeps its input block and casts
        inside: fp32 under autocast over fp32 parameters)."""
        return self.grid_layer_norm_saved_bytes(cfg, r, self.side(T), e, pb, r.residual * max(e, pb) if output_kept else 0)

    def image_embedding_saved_bytes(self, cfg, T: int, batch: int, e: int, pb: int) -> int:
        return self.grid_image_embedding_saved_bytes(cfg, batch, self.batch_split(T), self.side(T), e)

    def class_head_saved_bytes(self, cfg, T: int, r: RankShape, batch: int, e: int, pb: int,
                               sequence_parallel: bool = False) -> int:
        return self.grid_class_head_saved_bytes(cfg, r, batch, self.side(T), e, pb)

    def autocast_weight_elements(self, cfg, T: int) -> tuple:
        """None: the 3D product saves the fp32 parameter block and casts inside."""
        return 0, 0

    def head_and_loss_saved_bytes(self, cfg, T: int, r: RankShape, e: int) -> int:
        """2D's, plus at a tied head :func:`tied_head_saved_bytes`."""
        extra = tied_head_saved_bytes(cfg, T, e) if getattr(cfg, "tie_embeddings", False) else 0
        return self.masked_loss_bytes(r) + FP32 + extra

    def bias_rules(self, T: int, width: int) -> list:
        q = self.side(T)
        return [DivisibilityRule("ffn_hidden", width, q ** 3, "q³",
                                 f"in 3D the MLP's first bias is stored in q³={q ** 3} blocks",
                                 fix=f"use a multiple of {q ** 3}")]

    def tensor_comm(self, cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> dict:
        """:func:`gridshard.tensor.tp3d.cost.tensor_comm_3d`: each cube axis priced on its own link."""
        return {axis: [v] for axis, v in tensor_comm_3d(cfg, layout, seq, layers, first, last, e).items()}

    def tensor_axis_levels(self, T: int, world: int, per_node: int):
        return cube_axis_levels(self.side(T), world, per_node)

    plan_title, plan_rivals = "3D", ("2d", "2.5d")

    def plan_summary(self, layout, links: dict, verdict: str) -> str:
        q = self.side(layout.tensor)
        inter = [a for a, lv in links.get("tensor_axes", {}).items() if lv == "inter"]
        return (f"(q = {q}: a {q}×{q}×{q} cube, every weight and activation 1/T per rank, m/q² = "
                f"{layout.micro_batch / (q * q):g} sequences per rank) {verdict}; cube axes across nodes: "
                f"{', '.join(inter) if inter else 'none'}")


def _set_cube(mesh, cube) -> None:
    """``cube`` (the residual orientation), ``cube_side`` and the residual batch block i·q + j of q²."""
    mesh.cube, mesh.cube_side = cube, cube.q
    assert mesh.tensor.rank == cube.batch_index * cube.q + cube.hidden_index, "t = (i·q + j)·q + l"
    mesh.batch_blocks, mesh.batch_index = cube.q ** 2, cube.batch_index


def tied_head_saved_bytes(cfg, T: int, e: int) -> int:
    """What a 3D tied head (:mod:`gridshard.tensor.tp3d.tied_head`) keeps beyond an untied one, per micro-batch:
    its product saves the weight slice [V_p/q, h/q²] (V_p = ⌈V/q²⌉·q²) cut from the table gathered over
    ``batch`` [V_p, h/q], copied (contiguous, then cast to the activations' dtype), so V_p·h/q³·e."""
    q = icbrt(T)
    vp = padded_vocab_size(cfg.vocab_size, q * q)
    return vp * cfg.hidden // q ** 3 * e
