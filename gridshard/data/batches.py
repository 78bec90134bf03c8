"""Deterministic global batches, identical at every layout, sharded over data ranks.

Step k's global batch is ``G`` windows of ``s + 1`` consecutive tokens; window i starts
at ``offset[k, i]``, drawn uniformly from ``[0, n − s − 1]`` by numpy's PCG64 seeded with
``(seed, k)`` — so it depends only on (data, seed, step, G, s), never on the layout.
Tokens are ``window[:-1]`` and targets ``window[1:]``.

Validation batches come from the same law on the validation tokens with a third seed word:
batch j of an evaluation draws its offsets with PCG64 seeded ``(seed, j, 1)`` (``stream=1``),
so every evaluation reads the same windows, at every layout.

Sharding: with D data ranks and micro-batch m, each optimizer step accumulates
``A = G / (m·D)`` micro-batches per rank. Data rank d owns the contiguous rows
``[d·G/D, (d+1)·G/D)`` and feeds them in order as A micro-batches of m rows. Every
global row is used exactly once per step. (In 2D the tensor group further splits a
micro-batch over its grid rows with ``ParallelContext.shard_tokens``.)

Masked targets (``ignore_token``, the config's ``data.ignore_token``): targets equal to it
are left out of the loss, so micro-batches hold different numbers of valid targets and
the mean of per-micro-batch means is no longer the global mean. The normaliser the
trainer needs is N_k = #(targets ≠ ignore_token) over the whole global batch of step k;
since that batch is a function of (data, seed, k) alone, every rank reads it and counts
N_k itself — no communication, the same integer on every rank
(:meth:`BatchPlan.step_batches`). Reading the global batch also checks every global id
against the vocabulary on every rank, so a bad id raises the same error everywhere.
Without ``ignore_token`` N_k = G·s and a rank reads only its own rows.

Packed windows (``data.packing`` concat / first_fit, ``data.document_mask``): a
:class:`gridshard.data.packing.Packer` cuts the windows and numbers their documents; step k draws
its G picks with the same PCG64 words (concat's picks are the very offsets above, so its windows
are ``none``'s). Targets the packing leaves untrained (padding; with document masks, each
document's last target) become the ignored id and are counted out of N; with document masks a
micro-batch is (tokens, targets, document ids) [m, s] each, the ids of the tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError

#: the target id the loss ignores when ``data.ignore_token`` is unset (``F.cross_entropy``'s default)
IGNORED = -100


def step_offsets(n_tokens: int, seq_len: int, global_batch: int, seed: int, step: int,
                 stream: int = 0) -> np.ndarray:
    """Start positions [G] of step ``step``'s windows (see the module docstring); ``stream`` 0
    is training (seed words (seed, step)), 1 validation (seed words (seed, step, 1))."""
    if n_tokens - seq_len - 1 < 0:
        raise ConfigError(f"the data holds {n_tokens} tokens but a sequence needs data.seq_len+1 = {seq_len + 1}. "
                          f"Fix: use more data or a shorter data.seq_len.")
    return step_draws(n_tokens - seq_len, global_batch, seed, step, stream)


def step_draws(choices: int, global_batch: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """G integers uniform in [0, ``choices``) for step ``step`` (the seed words of :func:`step_offsets`)."""
    rng = np.random.Generator(np.random.PCG64([seed, step] if stream == 0 else [seed, step, stream]))
    return rng.integers(0, choices - 1, size=global_batch, endpoint=True)


def rank_rows(global_batch: int, data_size: int, data_rank: int) -> slice:
    """Rows of the global batch owned by data rank ``data_rank``."""
    per = global_batch // data_size
    return slice(data_rank * per, (data_rank + 1) * per)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, vocab_size: int) -> torch.Tensor:
    """[len(offsets), s+1] int64 tensor of token windows; rejects ids ≥ ``vocab_size``."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    return _checked(np.asarray(tokens[idx], dtype=np.int64), vocab_size)


def _checked(out: np.ndarray, vocab_size: int) -> torch.Tensor:
    if out.size and int(out.max()) >= vocab_size:
        raise ConfigError(f"the data contains token id {int(out.max())} but model.vocab_size={vocab_size}: every id "
                          f"must be < vocab_size. Fix: raise model.vocab_size or check data.token_dtype.")
    return torch.from_numpy(out)


class BatchPlan:
    """Which tokens this data rank feeds at each step (module docstring)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, micro_batch: int,
                 data_size: int, data_rank: int, seed: int, vocab_size: int, ignore_token=None, stream: int = 0,
                 packer=None):
        self.tokens, self.seq_len, self.seed, self.vocab_size = tokens, seq_len, seed, vocab_size
        self.stream = stream
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rows = rank_rows(global_batch, data_size, data_rank)
        self.ignore_token = ignore_token
        self.packer = packer                # gridshard.data.packing.Packer, or None (packing: none)

    def micro_batches(self, step: int) -> list:
        """The A = G/(m·D) pairs (tokens [m, s], targets [m, s]) of this rank for ``step``
        (:func:`gridshard.job_layout.micro_batches_per_step`)."""
        return self.step_batches(step)[0]

    def step_batches(self, step: int) -> tuple:
        """(this rank's :meth:`micro_batches` of ``step``, N: the valid targets of the whole
        global batch of ``step`` — targets ≠ ``ignore_token``, over all micro-batches and data
        ranks; G·s without ``ignore_token``). The same N on every rank (module docstring)."""
        if self.packer is not None:
            return self._packed(step)
        offs = step_offsets(len(self.tokens), self.seq_len, self.global_batch, self.seed, step, self.stream)
        if self.ignore_token is None:
            w = windows(self.tokens, offs[self.rows], self.seq_len, self.vocab_size)
            n_valid = self.global_batch * self.seq_len
        else:
            every = windows(self.tokens, offs, self.seq_len, self.vocab_size)     # the whole global batch
            n_valid = int((every[:, 1:] != self.ignore_token).sum())
            w = every[self.rows]
        return [(c[:, :-1], c[:, 1:]) for c in w.split(self.micro_batch, dim=0)], n_valid

    def _packed(self, step: int) -> tuple:
        """:meth:`step_batches` of packed windows (module docstring, "Packed windows")."""
        picks = step_draws(self.packer.choices, self.global_batch, self.seed, step, self.stream)
        w, docs, trained = self.packer.windows(picks)
        every = _checked(w, self.vocab_size)
        if self.ignore_token is not None:
            trained &= w[:, 1:] != self.ignore_token
        targets = every[:, 1:].masked_fill(torch.from_numpy(~trained), IGNORED if self.ignore_token is None
                                           else self.ignore_token)
        parts = [every[self.rows, :-1], targets[self.rows]]
        if self.packer.document_mask:
            parts.append(torch.from_numpy(docs[self.rows, :-1]))
        return list(zip(*(p.split(self.micro_batch, dim=0) for p in parts))), int(trained.sum())
