"""TiedVocabHead3D: the LM head reading the 3D embedding's own table (tied embeddings).

The tied head computes logits = x·Eᵀ with E [V_pad, h] the table of a
:class:`gridshard.tensor.tp3d.embedding.VocabParallelEmbedding3D` on the residual orientation ``M``
(rank (i, j, l) = weight, input, output coordinates). The two layers want different blocks of E:

* the embedding holds  E[vocab block i·q + j of q², hidden block l of q]        [V_pad/q², h/q]
* a 3D head on ``M`` (:class:`gridshard.tensor.tp3d.linear.VocabParallelClassifier3D`, weight W = Eᵀ
  [h, V_pad]) multiplies W[in block l·q + i of q², out block j of q], i.e.
                         E[vocab block j of q, hidden block l·q + i of q²]ᵀ     [h/q², V_pad/q]

Both live in hidden block l (hidden block l·q + i of q² is sub-block i of block l), and the q²
ranks of ``M.batch`` (same l, members i·q + j in vocab-block order) hold between them the whole
hidden block l. So the head all-gathers the table blocks over ``batch`` (→ E[:, hidden block l],
[V_pad, h/q]), keeps vocab block j and hidden sub-block i, and runs the 3D product
(:func:`gridshard.tensor.tp3d.matmul.matmul_3d`) on it. Backward is the dual: the product's dA
(reduce-scattered over ``weight``) lands in the kept slice, and the all-gather's dual
reduce-scatters [V_pad, h/q] over ``batch``, so every table block gets the exact sum of the head's
and the embedding's gradients (no second parameter, no gradient sync).

V_pad = ⌈V/q²⌉·q² (the embedding's padding, a multiple of q as the head needs); padding rows are
zero, so the padded logits are 0 and the 3D loss masks them (``vocab_size``). Logits block
[b/q², s, V_pad/q] in ``M.swapped()``'s layout (``self.out_mesh``), as the untied head's.

Communication per forward + backward beyond the untied head's: the table all-gather over
``batch``, V_pad·h/q·e payload, and its reduce-scatter of the same size (:func:`tied_head_extra_bytes`).
The untied head gathers its weight over ``weight`` (V_pad·h/q²·e) instead of this; the price of
sharing one parameter is the q-times larger gather of the table's hidden block. Saved for
backward beyond the untied head: the slice [h/q², V_pad/q] as its own copy (a view would keep the
whole gathered [V_pad, h/q] table alive, q² times more).
"""
from __future__ import annotations

import torch

from ...comm.grid_ops import gather_along
from ..grid_embedding import GridTiedHead
from .embedding import VocabParallelEmbedding3D
from .matmul import matmul_3d


def tied_head_extra_bytes(padded_vocab: int, hidden: int, q: int, bytes_per_element: int = 4) -> dict:
    """Per rank, forward + backward: the table's all-gather and its dual reduce-scatter over ``batch``
    (payload V_pad·h/q·e each, module docstring)."""
    n = padded_vocab * hidden // q * bytes_per_element
    return {"all_gather": n, "reduce_scatter": n}


class TiedVocabHead3D(GridTiedHead):
    """LM head sharing a VocabParallelEmbedding3D table (module docstring)."""

    embedding_class = VocabParallelEmbedding3D

    def __init__(self, embedding: VocabParallelEmbedding3D):
        super().__init__(embedding)
        self.out_mesh = embedding.mesh.swapped()
        self.out_local = self.padded_vocab // self.mesh.q       # logits block width, V_pad/q

    def logits(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        mesh, q = self.mesh, self.mesh.q
        table = gather_along(table, mesh.batch, 0)                               # [V_pad, h/q], hidden block l
        w = table.chunk(q, 0)[mesh.input.rank].chunk(q, 1)[mesh.weight.rank]    # [V_pad/q, h/q²]
        w = w.t().contiguous()        # a copy: the product saves it, not a view keeping the whole table alive
        return matmul_3d(x, w.to(x.dtype), mesh)
