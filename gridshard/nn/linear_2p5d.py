"""2.5D (Tesseract) linear layers: the 2D layer on my depth layer's grid + the depth sum of
its weight gradients (:mod:`gridshard.comm.depth_ops`). No code of the 2D layers is repeated.

Layout (rank (k, i, j): depth layer k, grid position (i, j); :mod:`gridshard.comm.mesh_2p5d`):

* input  x [b, s, in]  → block [b/(d·q), s, in/q] = x[batch block k·q + i, :, in block j];
* weight W [in, out]   → block [in/q, out/q]     = W[in block i, out block j], the same on all
  d layers (replicated over depth);
* bias   b [out]       → block [out/q²]          (as 2D, replicated over depth);
* output y [b, s, out] → block [b/(d·q), s, out/q].

Products (N = b·s tokens, N/d of them in a depth layer; all three are 2D's SUMMA products on
the layer's grid, :mod:`gridshard.comm.summa`, each with its dual backward):

    forward   Y_k = X_k·W           A·B    (row: X panels, col: W panels)
    backward  dX_k = dY_k·Wᵀ        A·Bᵀ   (col all-gather of W, row reduce-scatter)
              dW_k = X_kᵀ·dY_k       Aᵀ·B   (row all-gather of X_k, col reduce-scatter)
              dW = Σ_k dW_k          all-reduce over ``depth`` (one per parameter)

So per rank: parameters (in·out + out)/q² (as 2D: 1/q² of the layer, replicated d times),
saved for backward the input block N·in/(d·q²) (1/(d·q²) of one device's), and the 2D traffic
of an N/d-token layer plus the depth all-reduce of the weight (and bias) block:
:func:`gridshard.theory.tp2p5d.linear2p5d_comm`.

``VocabParallelClassifier2p5D`` is the 2D LM head (h → V_pad, no bias) the same way;
``TiedVocabHead2p5D`` is the 2D tied head on a :class:`VocabParallelEmbedding2p5D`'s table
(logits = X·Eᵀ, SUMMA A·Bᵀ): the table is the embedding's parameter, whose gradient (both uses
summed by autograd) the embedding's hook already sums over depth, so the head registers none.
"""
from __future__ import annotations

from ..comm.depth_ops import reduce_grads_over_depth
from .classifier_2d import TiedVocabHead2D, VocabParallelClassifier2D
from .embedding_2p5d import VocabParallelEmbedding2p5D
from .linear_2d import Linear2D


class Linear2p5D(Linear2D):
    """y = x·W + b on a 2.5D mesh (module docstring); ``mesh`` is a
    :class:`gridshard.comm.mesh_2p5d.Mesh2p5D`, the other arguments are :class:`Linear2D`'s."""

    def __init__(self, in_features: int, out_features: int, mesh, **kwargs):
        super().__init__(in_features, out_features, mesh.grid, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, d={self.mesh_2p5d.d}"


class VocabParallelClassifier2p5D(VocabParallelClassifier2D):
    """LM head h → V_pad (no bias) on a 2.5D mesh: logits block [b/(d·q), s, V_pad/q]."""

    def __init__(self, hidden: int, vocab: int, mesh, **kwargs):
        super().__init__(hidden, vocab, mesh.grid, **kwargs)
        self.mesh_2p5d = mesh
        reduce_grads_over_depth(self, mesh.depth)


class TiedVocabHead2p5D(TiedVocabHead2D):
    """Tied LM head on a :class:`VocabParallelEmbedding2p5D` (no hook of its own: module docstring)."""

    def __init__(self, embedding: VocabParallelEmbedding2p5D, overlap: bool = True):
        if not isinstance(embedding, VocabParallelEmbedding2p5D):
            raise TypeError(f"TiedVocabHead2p5D needs a VocabParallelEmbedding2p5D (whose table's gradient is summed "
                            f"over depth), got {type(embedding).__name__}")
        super().__init__(embedding, overlap)
        self.mesh_2p5d = embedding.mesh_2p5d
