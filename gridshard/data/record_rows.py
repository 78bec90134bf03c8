"""Batches of record sources (``data.kind: hf | chat``): one record stream per global row,
each rank reading only its rows' records, resumable exactly at any layout.

Global row g of every step (0 ≤ g < G) is fed by its own stream of records g, g + G, g + 2G, …
of the endless record sequence (:class:`gridshard.data.records.RecordSource`): step k's row g is
the k-th window that stream makes. Data rank d owns rows [d·G/D, (d+1)·G/D) (as for token
sources), so two data ranks read disjoint records, and a rank tokenises only its own. Which
records form which window depends on G and the data alone, never on D or the rest of the layout.

A row's windows (w = s + 1 tokens; tokens = window[:-1], targets = window[1:]):

* ``packing: none | concat``: the row's records, each one document, one after the other; window
  k + 1 starts at window k's last token (a stride of s, every target used once);
* ``first_fit``: the row's records taken 16 at a time (:data:`FIT_RECORDS`), placed into windows
  by :func:`gridshard.data.packing.first_fit` (longer ones cut), the windows fed in order, the rest
  of each window padding (its own document, targets ignored).

A target counts when its token's trained flag is set (hf: every token; chat: the assistant's),
and — with ``data.document_mask`` — when it lies in its input token's document. N, the valid
targets of the whole global batch, is the sum of each data rank's own count: one all-reduce of an
integer over the data axis per step (``sum_over_data``: an int64 tensor summed over the data axis),
the only communication of the data.

**Position.** A row's position is two integers: (record in hand, offset into it) for concat,
(first record of the 16 in hand, next window among theirs) for first_fit. :meth:`RecordRows.position`
is the whole table [G, 2] (each rank fills its rows, the rest summed in over the data axis), saved
in the checkpoint's ``meta.json`` as ``data_position``; a resumed run, at any D, loads the table
and continues every row where it stopped, so it feeds exactly the batches an uninterrupted run
feeds (``tests/test_record_data.py`` hashes them). A stream is read again from the smallest
position among the rank's rows (records below a row's position are skipped, not tokenised).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import numpy as np
import torch

from ..errors import ConfigError
from .batches import IGNORED, _checked, rank_rows
from .packing import first_fit

#: records a first_fit row packs together
FIT_RECORDS = 16


class _Feed:
    """Records for this rank's rows, in each row's order (module docstring); a stream is read once
    for all the rank's rows, each record queued for the row that owns it."""

    def __init__(self, source, rows: list, G: int, starts: dict):
        self.source, self.G, self.starts = source, G, dict(starts)
        self.queues = {g: deque() for g in rows}
        self.stream = source.records(min(starts.values())) if source.streaming else None

    def take(self, g: int, at: int) -> dict:
        """Row ``g``'s record ``at`` (rows ask for their records in order)."""
        if self.stream is None:
            return self.source.dataset[at % self.source.size]
        queue = self.queues[g]
        while not queue or queue[0][0] < at:
            if queue:
                queue.popleft()
                continue
            i, record = next(self.stream)
            owner = self.queues.get(i % self.G)
            if owner is not None and i >= self.starts[i % self.G]:
                owner.append((i, record))
        return queue.popleft()[1]


class RecordRows:
    """The batch plan of a record source (module docstring)."""

    def __init__(self, source, tokenize: Callable, seq_len: int, global_batch: int, micro_batch: int,
                 data_size: int, data_rank: int, packing: str, document_mask: bool, pad: int, vocab_size: int,
                 sum_over_data: Callable, ignore_token: Optional[int] = None):
        self.source, self.tokenize, self.width, self.G = source, tokenize, seq_len + 1, global_batch
        self.micro_batch, self.packing, self.document_mask, self.pad = micro_batch, packing, document_mask, pad
        self.vocab_size, self.sum_over_data = vocab_size, sum_over_data
        self.ignored = IGNORED if ignore_token is None else ignore_token
        self.rows = list(range(global_batch))[rank_rows(global_batch, data_size, data_rank)]
        self.load_position(np.stack([np.arange(global_batch), np.zeros(global_batch, np.int64)], 1), step=0)

    # ---- position ------------------------------------------------------------------------
    def load_position(self, table, step: int) -> None:
        """Continue from ``table`` [G, 2] (:meth:`position` of an earlier run) at step ``step``."""
        table = np.asarray(table, np.int64)
        if table.shape != (self.G, 2) or bool((table[:, 0] % self.G != np.arange(self.G)).any()):
            raise ConfigError(f"the checkpoint's data position has shape {table.shape} or rows out of place, not the "
                              f"[{self.G}, 2] table of train.global_batch={self.G} rows. Fix: resume with the global "
                              f"batch and data the checkpoint was written with.")
        self.pos = {g: [int(table[g, 0]), int(table[g, 1])] for g in self.rows}
        self.next_step, self.hand = step, {}
        self.feed = _Feed(self.source, self.rows, self.G, {g: p[0] for g, p in self.pos.items()})

    def position(self) -> list:
        """The [G, 2] position table of every row: each rank fills its own rows, the table is summed
        over the data axis (collective: every rank calls it)."""
        table = torch.zeros(self.G, 2, dtype=torch.int64)
        for g, (a, b) in self.pos.items():
            table[g] = torch.tensor([a, b])
        return self.sum_over_data(table).tolist()

    # ---- windows ---------------------------------------------------------------------------
    def _record(self, g: int, at: int) -> tuple:
        if self.hand.get(g, (None,))[0] != at:
            self.hand[g] = (at, *self.tokenize(self.feed.take(g, at)))
        return self.hand[g][1:]

    def _concat(self, g: int) -> tuple:
        at, off = self.pos[g]
        ids, flags, docs = [], [], []
        d, need = 0, self.width
        while need:
            r_ids, r_flags = self._record(g, at)
            take = min(need, len(r_ids) - off)
            ids.append(r_ids[off:off + take])
            flags.append(r_flags[off:off + take])
            docs.append(np.full(take, d))
            need -= take
            if need:
                at, off, d = at + self.G, 0, d + 1
            else:
                off += take
        self.pos[g] = self._advance(g, at, off)
        return np.concatenate(ids), np.concatenate(flags), np.concatenate(docs)

    def _advance(self, g: int, at: int, end: int) -> list:
        """The position of the next window's first token: the last token of this one (at, end − 1)."""
        return [at, end - 1]

    def _first_fit(self, g: int) -> tuple:
        first, j = self.pos[g]
        key = ("fit", first)
        if self.hand.get(g, (None,))[0] != key:
            records = [self.tokenize(self.feed.take(g, first + i * self.G)) for i in range(FIT_RECORDS)]
            ids = np.concatenate([r[0] for r in records])
            flags = np.concatenate([r[1] for r in records])
            starts = np.cumsum([0] + [len(r[0]) for r in records[:-1]])
            self.hand[g] = (key, ids, flags, first_fit(starts, len(ids), self.width))
        _, ids, flags, bins = self.hand[g]
        w, f, docs = np.full(self.width, self.pad), np.zeros(self.width, bool), np.empty(self.width, np.int64)
        at = 0
        for d, (a, e) in enumerate(bins[j]):
            w[at:at + e - a], f[at:at + e - a], docs[at:at + e - a] = ids[a:e], flags[a:e], d
            at += e - a
        docs[at:] = len(bins[j])
        self.pos[g] = [first, j + 1] if j + 1 < len(bins) else [first + FIT_RECORDS * self.G, 0]
        return w, f, docs

    def step_batches(self, step: int) -> tuple:
        """(this rank's micro-batches of ``step`` — (tokens, targets[, document ids]) [m, s] —, N)."""
        if step != self.next_step:
            raise ConfigError(f"data.kind={getattr(self.source, 'kind', 'hf')} feeds its rows in order, and step "
                              f"{step} was asked after step {self.next_step - 1}. Fix: read the steps in order "
                              f"(a resumed run loads the checkpoint's data position).")
        self.next_step += 1
        make = self._first_fit if self.packing == "first_fit" else self._concat
        w, flags, docs = map(np.stack, zip(*(make(g) for g in self.rows)))
        trained = flags[:, 1:] & (w[:, 1:] != self.ignored)       # padding's flags are unset
        if self.document_mask:
            trained &= docs[:, 1:] == docs[:, :-1]
        tokens = _checked(w.astype(np.int64), self.vocab_size)
        targets = tokens[:, 1:].masked_fill(torch.from_numpy(~trained), self.ignored)
        parts = [tokens[:, :-1], targets] + ([torch.from_numpy(docs[:, :-1])] if self.document_mask else [])
        n_valid = int(self.sum_over_data(torch.tensor([int(trained.sum())]))[0])
        return list(zip(*(p.split(self.micro_batch, dim=0) for p in parts))), n_valid
