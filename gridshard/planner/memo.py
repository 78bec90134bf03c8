"""Hashable keys for the planner's memos (``functools.lru_cache`` on pure functions).

The planner asks for the same rank's parameter blocks for many layouts of a search
(:func:`gridshard.planner.cost_time._blocks_memo`: measured, 270 distinct keys and 12918 hits
over the plans of configs/llama_7b.yaml on 64 GPUs and configs/gpt_125m.yaml on 16), and each
``cfg.model.resolve()`` gives a new, unhashable :class:`gridshard.models.ModelConfig`.
:func:`model_key` turns a config into a value (its class and fields) that a memo can key
on; :func:`model_of` gives an equal config back.
"""
from __future__ import annotations


def model_key(cfg) -> tuple:
    """(class, sorted field items) of a model config: equal configs give equal keys."""
    return type(cfg), tuple(sorted(vars(cfg).items()))


def model_of(key: tuple):
    """The model config of a :func:`model_key`."""
    cls, items = key
    return cls(**dict(items))
