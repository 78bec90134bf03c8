"""Vocabulary-parallel token embedding producing a 3D activation layout [b/q², s, h/q].

On a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` orientation, rank (i, j, l) takes its tokens
[b/q², s] (batch block i·q + j, :meth:`Mesh3D.batch_block` with ``hidden=False``) and returns
x[batch block i·q + j, :, hidden block l].

Table (global [V, h] drawn ``normal_(0, init_std)``, zero rows appended to V_pad = ⌈V/q²⌉·q²,
never looked up): rank (i, j, l) holds E[vocab block i·q + j of q², hidden block l of q],
[V_pad/q², h/q] (1/T of the table). The q² ranks of ``mesh.batch`` hold hidden block l between
them, one vocab block each — the 2D vocab-parallel embedding with ``batch`` (q² ranks) in the
role of the grid column:

    1. all-gather the int tokens over ``batch`` → every rank holds the whole micro-batch [b, s]
       (b·s·8 bytes); the id range is checked on it locally, alike on every rank of the cube
       (:func:`gridshard.nn.id_range.check_blocks`: the error names the batch block), so no rank
       raises alone while another waits in the next collective;
    2. look up the tokens in my vocab block (others give 0) → a partial [b, s, h/q];
    3. reduce-scatter over ``batch`` on the batch dim → member i·q + j keeps batch block
       i·q + j, summed over the q² vocab blocks: [b/q², s, h/q].

Backward: the reduce-scatter's dual all-gathers the output gradient over ``batch``
(b·s·h/q·e), then a local masked embedding backward gives the exact gradient of my table block.
Communication: :func:`gridshard.tensor.tp3d.theory.embedding3d_comm`.
"""
from __future__ import annotations

from ..grid_embedding import GridVocabEmbedding
from .linear import hidden_cut_3d


class VocabParallelEmbedding3D(GridVocabEmbedding):
    """Vocabulary split over ``mesh.batch`` (q² blocks), hidden over ``mesh.output`` (module docstring;
    :mod:`gridshard.tensor.grid_embedding` with ``batch`` as ``gather``)."""

    hidden_cut = staticmethod(hidden_cut_3d)
