"""The load-balanced split of a sequence over a context axis of C ranks.

The sequence of S tokens is cut into 2·C equal chunks of c = S / (2C) tokens; context rank i
holds chunks i and 2C − 1 − i, concatenated in that order (2c tokens). Under a causal mask the
work of a query chunk grows with its index, so pairing an early chunk with a late one gives every
rank the same attention work: rank i's two chunks attend to (i + 1) + (2C − i) = 2C + 1 chunks
in all, whatever i is.

Positions: local token t of rank i has the global index

    t < c:  i·c + t            (chunk i)
    t ≥ c:  (2C − 1 − i)·c + (t − c)   (chunk 2C − 1 − i)

which is what rotary embeddings and the causal mask read (:func:`global_positions`).
"""
from __future__ import annotations

import torch

from ..job_layout import check_context_sequence


def chunk_indices(context_size: int, rank: int) -> tuple:
    """The global chunk indices (i, 2C − 1 − i) context rank ``rank`` holds."""
    return rank, 2 * context_size - 1 - rank


def shard_sequence(x: torch.Tensor, context_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's 2c tokens of the global ``x`` along ``dim``: chunks i and 2C − 1 − i."""
    check_context_sequence(x.shape[dim], context_size)
    chunks = x.chunk(2 * context_size, dim=dim)
    first, second = chunk_indices(context_size, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list, dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's :func:`shard_sequence` part, in rank order."""
    C = len(parts)
    chunks = [None] * (2 * C)
    for rank, part in enumerate(parts):
        first, second = chunk_indices(C, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def global_positions(local_len: int, context_size: int, rank: int, device=None) -> torch.Tensor:
    """Global token index of each of this rank's ``local_len`` = 2c tokens (module docstring)."""
    c = local_len // 2
    first, second = chunk_indices(context_size, rank)
    t = torch.arange(c, device=device)
    return torch.cat([first * c + t, second * c + t])
