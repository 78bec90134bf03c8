"""Packing documents into training windows, and the document ids their masks read.

A token source is a stream of documents. Their **starts** (sorted token indices, the first 0) come
from the end-of-document token ``data.eod_token`` (a document ends with it: the next token starts
the next one) or, for a prepared folder without one, from the record boundaries
``gridshard prepare-data`` wrote (``doc_starts.npy``, :func:`document_starts`).

``data.packing`` cuts windows of w = s + 1 tokens (tokens = window[:-1], targets = window[1:]):

* ``none`` (the default): windows at uniform offsets of the stream (:mod:`gridshard.data.batches`),
  blind to documents;
* ``concat``: the same windows, with each token's document known;
* ``first_fit``: whole documents placed into windows, each document (in stream order) into the
  first window with room for it; a document longer than w is first cut into pieces of w tokens
  (each piece a document of its own). A window's unused tail is padding: its own document, its
  tokens the pad id (the eod token, else 0), its targets ignored. Step k's windows are G window
  indices drawn uniformly with PCG64 seeded (seed, k) — layout-independent, as the offsets are.

**Document ids** [w] number the window's documents 0, 1, … in order (``gridshard.nn.documents``).
With ``data.document_mask`` the model attends within documents and restarts positions per
document, and the target of each document's last token (the next document's first token, which
nothing in the document can predict) is ignored, as are padding's targets: so every document of a
packed window gives the logits and loss it gives alone. These ignored targets are counted out of
``valid_tokens`` N like ``data.ignore_token``'s (the whole global batch is read on every rank).

first_fit bins with a max segment tree over the windows' free room: placing n documents into W
windows costs O(n log W).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ..errors import ConfigError
from .prepared_folder import DOC_STARTS

PACKINGS = ("none", "concat", "first_fit")


def document_starts(tokens: np.ndarray, eod: Optional[int], prepared: Optional[str] = None,
                    begin: int = 0, chunk: int = 1 << 24) -> np.ndarray:
    """Sorted int64 start indices of the documents of ``tokens`` (always starting with 0): after each
    ``eod`` token, else the record starts of the prepared folder ``prepared`` within
    [``begin``, ``begin`` + len(tokens)), shifted to ``tokens``' own indices."""
    n = len(tokens)
    if eod is not None:
        ends = [a + np.flatnonzero(np.asarray(tokens[a:a + chunk]) == eod) + 1 for a in range(0, n, chunk)]
        starts = np.concatenate([np.zeros(1, np.int64)] + [e.astype(np.int64) for e in ends])
    elif prepared is not None:
        starts = np.load(os.path.join(prepared, DOC_STARTS), allow_pickle=False).astype(np.int64)
        starts = np.concatenate([[0], starts[(starts > begin) & (starts < begin + n)] - begin])
    else:
        raise ConfigError("data.packing / data.document_mask need document boundaries, and this source has no "
                          "end-of-document token. Fix: set data.eod_token (e.g. 10, a newline, for stdlib/text bytes) "
                          "or use a prepared folder.")
    return np.unique(starts[starts < n])


class _FreeRoom:
    """Max segment tree over windows' free room: the first window with room ≥ need, in O(log W)."""

    def __init__(self, windows: int, room: int):
        self.size = 1 << max(0, (windows - 1).bit_length())
        self.tree = np.zeros(2 * self.size, np.int64)
        self.tree[self.size:self.size + windows] = room
        for i in range(self.size - 1, 0, -1):
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def take(self, need: int) -> int:
        if self.tree[1] < need:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        self.tree[i] -= need
        at, i = i - self.size, i // 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2
        return at


def first_fit(starts: np.ndarray, n_tokens: int, width: int) -> list:
    """Windows of at most ``width`` tokens, each a list of (start, end) stream ranges: every
    document (cut into pieces of ``width`` when longer) in the first window with room (module doc)."""
    bounds = np.append(starts, n_tokens)
    pieces = [(a, min(a + width, e)) for s, e in zip(bounds[:-1], bounds[1:]) for a in range(int(s), int(e), width)]
    free = _FreeRoom(len(pieces), width)
    windows: list = []
    for a, e in pieces:
        at = free.take(e - a)
        if at == len(windows):
            windows.append([])
        windows[at].append((a, e))
    return windows


class Packer:
    """Windows with document ids for one token stream (module docstring): ``choices`` is how many
    windows a draw picks from, :meth:`windows` gives the picked ones."""

    def __init__(self, tokens: np.ndarray, seq_len: int, packing: str, starts: np.ndarray,
                 document_mask: bool, pad: int):
        self.tokens, self.width, self.packing, self.starts = tokens, seq_len + 1, packing, starts
        self.document_mask, self.pad = document_mask, pad
        self.bins = first_fit(starts, len(tokens), self.width) if packing == "first_fit" else None
        if packing == "first_fit" and not self.bins:
            raise ConfigError("data.packing=first_fit found no document in the data. Fix: use more data.")

    @property
    def choices(self) -> int:
        """Offsets (concat: 0 … n − w) or packed windows (first_fit) a draw picks from."""
        return len(self.bins) if self.bins is not None else len(self.tokens) - self.width + 1

    def windows(self, picks: np.ndarray) -> tuple:
        """(window tokens [n, w] int64, document ids [n, w] int64, trained [n, w − 1] bool: whether each
        target counts) of the picked offsets or windows."""
        if self.bins is None:
            idx = picks[:, None] + np.arange(self.width)[None, :]
            w = np.asarray(self.tokens[idx], dtype=np.int64)
            docs = np.searchsorted(self.starts, idx, side="right")
            docs -= docs[:, :1]
            trained = np.ones((len(picks), self.width - 1), bool)
        else:
            w = np.full((len(picks), self.width), self.pad, np.int64)
            docs = np.empty((len(picks), self.width), np.int64)
            trained = np.zeros((len(picks), self.width - 1), bool)
            for row, pick in enumerate(picks):
                at = 0
                for d, (a, e) in enumerate(self.bins[pick]):
                    w[row, at:at + e - a] = self.tokens[a:e]
                    docs[row, at:at + e - a] = d
                    at += e - a
                docs[row, at:] = len(self.bins[pick])        # the padding: a document of its own
                trained[row, :max(at - 1, 0)] = True
        if self.document_mask:
            trained &= docs[:, 1:] == docs[:, :-1]           # no target in the next document
        return w, docs, trained


def split_packers(data, tokens: np.ndarray, val_tokens: Optional[np.ndarray]) -> tuple:
    """(training :class:`Packer`, validation Packer or None) of the config's data section and its
    split (:func:`gridshard.data.sources.load_split`); (None, None) for ``packing: none``."""
    if data.packing == "none":
        return None, None

    def packer(part, folder, begin):
        starts = document_starts(part, data.eod_token, folder if data.kind == "prepared" else None, begin)
        return Packer(part, data.seq_len, data.packing, starts, data.document_mask,
                      pad=0 if data.eod_token is None else data.eod_token)

    val = None if val_tokens is None else (packer(val_tokens, data.val_path, 0) if data.val_path
                                           else packer(val_tokens, data.path, len(tokens)))
    return packer(tokens, data.path, 0), val
