"""The planner's one memo: a rank's parameter blocks, keyed by hashable values.

The planner asks for the same rank's parameter blocks for many layouts of a search (the memory
of every candidate, its ZeRO communication and its optimizer work; measured before the blocks
were read from layouts: 270 distinct (model, mode, T, layers, ends) keys and 12918 hits over the
plans of configs/llama_7b.yaml on 64 GPUs and configs/gpt_125m.yaml on 16). The blocks are read
from a model laid out on the meta device (:func:`gridshard.parallel.rank_blocks.laid_out_model`,
about 2 ms), so two bounded ``functools.lru_cache`` levels keep that to one layout per (model,
tensor mode, T):

* :func:`_laid_out` — the laid-out one-layer model of (model, mode, T), 64 entries;
* :func:`_rank_blocks` — one rank's :class:`gridshard.theory.memory.ParamBlock` list (the
  layout's blocks for its layer ids and ends), 1024 entries.

Each ``cfg.model.resolve()`` gives a new, unhashable :class:`gridshard.models.ModelConfig`:
:func:`model_key` turns it into a value (its class and fields) a memo can key on, and
:func:`_laid_out` builds an equal config back from it. Callers read the lists, never change them.
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional


def model_key(cfg) -> tuple:
    """(class, sorted field items) of a model config: equal configs give equal keys."""
    return type(cfg), tuple(sorted(vars(cfg).items()))


def rank_blocks(cfg, mode, T: int, layer_ids: Optional[Iterable[int]], first: bool, last: bool,
                expert: int = 1) -> list:
    """:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`, memoised (module docstring)."""
    layers = tuple(range(cfg.layers)) if layer_ids is None else tuple(layer_ids)
    return _rank_blocks(model_key(cfg), str(mode), T, layers, first, last, expert)


@functools.lru_cache(maxsize=1024)
def _rank_blocks(model: tuple, mode: str, T: int, layer_ids: tuple, first: bool, last: bool, expert: int) -> list:
    return _laid_out(model, mode, T, expert).rank_blocks(layer_ids, has_embedding=first, has_head=last)


@functools.lru_cache(maxsize=64)
def _laid_out(model: tuple, mode: str, T: int, expert: int = 1):
    from ..parallel.rank_blocks import laid_out_model

    cls, items = model                     # a model_key: an equal config back
    return laid_out_model(cls(**dict(items)), mode, T, expert)
