"""The vocabulary-parallel token embedding of the 2D grid and the 3D cube, written once.

On a mode's hidden cut (:class:`gridshard.tensor.hidden_cut.HiddenCut`) the G ranks of the ``gather``
axis (2D: the grid column, G = q; 3D: ``batch``, G = q²) hold one hidden block of the table
between them, vocab block g of G each (V_pad = ⌈V/G⌉·G, zero rows appended after drawing, never
looked up), and one batch block of the activations each. Forward:

    1. all-gather the int tokens over ``gather`` → every member holds the whole micro-batch [b, s]
       (b·s·8 bytes); the id range is checked on it, alike on every rank of the mesh
       (:func:`gridshard.nn.id_range.check_blocks`: the error names the batch block), so no rank
       raises alone while another waits in the next collective;
    2. look up the tokens in my vocab block (others give 0) → a partial [b, s, h/q];
    3. reduce-scatter over ``gather`` on the batch dim → member g keeps batch block g, summed over
       the G vocab blocks: [b/G, s, h/q].

Backward: the reduce-scatter's dual all-gathers the output gradient over ``gather`` (b·s·h/q·e),
then a local masked embedding backward gives the exact gradient of my table block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.grid_ops import reduce_scatter_along
from ..errors import ShapeError, check_divisible
from ..nn.id_range import check_blocks
from ..theory.vocab import padded_vocab_size
from .grid_vision import _GridLayer
from .hidden_cut import padded_table_init


def check_token_ids(tokens: torch.Tensor) -> None:
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"embedding tokens must be integer ids, got dtype {tokens.dtype}. Fix: pass a LongTensor.")


class GridVocabEmbedding(_GridLayer):
    """Vocabulary split over the ``gather`` members, hidden as the activations (module docstring)."""

    def __init__(self, vocab: int, hidden: int, mesh, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.cut = cut = self.hidden_cut(mesh)
        check_divisible(hidden, mesh.q, "hidden", f"{cut.shape} side q")
        self.mesh, self.vocab, self.hidden = mesh, vocab, hidden
        self.padded_vocab = padded_vocab_size(vocab, cut.gather.size)
        self.vocab_local = self.padded_vocab // cut.gather.size
        self.vocab_start = cut.gather.rank * self.vocab_local
        self.weight = cut.parameter(cut.table_spec(vocab, self.padded_vocab, hidden),
                                    padded_table_init(vocab, hidden, init_std, self.padded_vocab), dtype, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_token_ids(tokens)
        gather = self.cut.gather
        all_tokens = C.all_gather(tokens.contiguous(), gather, 0)                # [b, s] on every rank
        check_blocks(all_tokens, self.vocab, f"{type(self).__name__} tokens", gather.size)   # alike on every rank
        local = all_tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        part = F.embedding(local.masked_fill(outside, 0), self.weight)           # [b, s, h/q]
        part = part.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along(part, gather, 0)                             # [b/G, s, h/q]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab} (padded {self.padded_vocab}), hidden={self.hidden}, q={self.mesh.q}"


class GridTiedHead(torch.nn.Module):
    """An LM head reading a :class:`GridVocabEmbedding`'s own table (tied embeddings). The table
    stays the embedding's (not a submodule); ``weight`` is the same Parameter, so the state_dict
    lists it under both names, like ``nn.Linear`` ties. A mode says which embedding it reads
    (``embedding_class``) and its product of this rank's [rows, h/q] input with the table
    (``logits``)."""

    embedding_class = GridVocabEmbedding

    def __init__(self, embedding: GridVocabEmbedding):
        super().__init__()
        if not isinstance(embedding, self.embedding_class):
            raise TypeError(f"{type(self).__name__} needs a {self.embedding_class.__name__}, "
                            f"got {type(embedding).__name__}")
        self._embedding = [embedding]
        self.weight, self.mesh = embedding.weight, embedding.mesh
        self.vocab, self.padded_vocab = embedding.vocab, embedding.padded_vocab
        self.hidden_local = embedding.hidden // self.mesh.q

    def logits(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_local:
            raise ShapeError(f"{type(self).__name__} got a local input with last dim {x.shape[-1]}; each rank holds "
                             f"hidden/q = {self.hidden_local}. Fix: pass this rank's "
                             f"[{self._embedding[0].cut.rows}, s, h/q] block.")
        y = self.logits(x.reshape(-1, self.hidden_local), self._embedding[0].weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"vocab={self.vocab} (padded {self.padded_vocab}), q={self.mesh.q}, tied"
