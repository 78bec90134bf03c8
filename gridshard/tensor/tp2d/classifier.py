"""Output layers on the 2D layout: a small classifier and the vocabulary-parallel LM head.

``Classifier2D`` (ViT / classification head, few classes C): input block
[b/q, …, h/q] at rank (i, j); weight [C, h] (global drawn [out=C, in=h] per the init
contract) stored as W[:, sub-block i of hidden block j] [C, h/q²]; output the *full*
logits of batch block i, [b/q, …, C], the same on every rank of row i.

    forward: all-gather W along the column → [C, h/q] (hidden block j);
             partial = x·W_jᵀ; all-reduce along the row (sum of hidden blocks);
             + bias (replicated [C], applied once).
    backward: the row all-reduce's dual is identity (every rank of the row holds the
             same logits and the same upstream gradient); dW_j is reduce-scattered
             along the column; the bias gradient is all-reduced along the column
             (sum of the q batch blocks), after which it is exact on every rank.

``ClsClassifier2D``: Classifier2D on the class token's row of [b/q, s, h/q] (the ViT head).

``VocabParallelClassifier2D`` (LM head): a Linear2D h → V_pad without bias; logits
block [b/q, s, V_pad/q] at (i, j) = logits[batch block i, :, vocab block j]. The global
weight is drawn as [V, h] (init contract), zero rows are appended to V_pad = ⌈V/q⌉·q and
the table is transposed to [h, V_pad]. The padded logits are 0; the 2D cross-entropy
masks them (``vocab_size`` tells it where the real vocabulary ends).

``TiedVocabHead2D``: logits = x·Eᵀ with the table E of a VocabParallelEmbedding2D
(block (i, j) = E[vocab block i, hidden block j]): that is exactly SUMMA A·Bᵀ, so the
head shares the embedding's parameter with no extra copy and the same output layout.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .summa import summa_abt
from ...theory.vocab import padded_vocab_size
from ..grid_embedding import GridTiedHead
from ..grid_vision import ClsHead, GridClassifier
from ..hidden_cut import padded_table_init
from .embedding import VocabParallelEmbedding2D
from .linear import Linear2D, hidden_cut_2d


class Classifier2D(GridClassifier):
    """Few-class head: [b/q, …, h/q] → full logits [b/q, …, C] (see module docstring)."""

    hidden_cut = staticmethod(hidden_cut_2d)


class ClsClassifier2D(ClsHead, Classifier2D):
    """The ViT head in 2D (:class:`gridshard.models.vit.ClsClassifier`): the class token's row of this
    rank's final hidden block [b/q, s, h/q] (the sequence is whole in 2D) → logits [b/q, C] of
    batch block i, the same on every rank of grid row i."""


class VocabParallelClassifier2D(Linear2D):
    """LM head: Linear2D h → V_pad, no bias, global weight drawn [V, h] (see module docstring)."""

    def __init__(self, hidden: int, vocab: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device=None, overlap: bool = True, vector_cache=None):
        padded = padded_vocab_size(vocab, mesh.q)
        super().__init__(hidden, padded, mesh, bias=False, dtype=dtype, device=device, overlap=overlap,
                         weight_init=padded_table_init(vocab, hidden, init_std, padded, transposed=True),
                         vector_cache=vector_cache)
        self.vocab_size, self.padded_vocab = vocab, padded
        self.weight.shard_spec = replace(self.weight.shard_spec, canonical_shape=(vocab, hidden))


class TiedVocabHead2D(GridTiedHead):
    """LM head sharing a VocabParallelEmbedding2D table [V_pad/q, h/q]: logits = x·Eᵀ by SUMMA A·Bᵀ."""

    embedding_class = VocabParallelEmbedding2D

    def __init__(self, embedding: VocabParallelEmbedding2D, overlap: bool = True):
        super().__init__(embedding)
        self.overlap = overlap

    def logits(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return summa_abt(x, table, self.mesh, self.overlap)
