"""Single-device reference layers under gridshard's initialisation contract.

These are the plain PyTorch modules that the sharded layers are tested against: built from
the same seed, they hold the *global* parameters whose blocks a sharded layer keeps.

Initialisation contract (so the same seed gives the same global model in every tensor
mode and at every T): a layer draws its *global* parameters from torch's default RNG, in
construction order, with these shapes and laws, and nothing else (construction is
``skip_init``, so ``nn.Module``'s own initialisation draws nothing); a sharded layer then
keeps its block (:func:`gridshard.nn.sharding.sharded_parameter`):

* linear weight: global [out, in] (PyTorch convention, even when a layer stores the
  transpose), ``normal_(0, init_std)``; bias: zeros.
* embedding / vocabulary-head weight: global [vocab, hidden], ``normal_(0, init_std)``;
  vocabulary padding rows (when the vocabulary does not split evenly) are appended
  *after* drawing and are zero.
* norm weight: ones.

Models are laid out by :func:`gridshard.parallelize`, which initialises meta parameters
with its own counter-based laws (:mod:`gridshard.parallel.materialize`); these helpers are
for layer-level tests and benchmarks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.utils import skip_init  # no RNG draws at construction: see the init contract

__all__ = ["plain_linear", "plain_embedding", "plain_lm_head"]


def plain_linear(in_features: int, out_features: int, bias: bool, init_std: float) -> nn.Linear:
    """``nn.Linear`` under the init contract: global [out, in] weight ``normal_(0, init_std)``,
    zero bias, no other RNG draws (so it matches every sharded layer built from the same seed)."""
    lin = skip_init(nn.Linear, in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, init_std)
        if bias:
            lin.bias.zero_()
    return lin


def plain_embedding(vocab: int, hidden: int, init_std: float) -> nn.Embedding:
    """``nn.Embedding`` under the init contract: global [vocab, hidden] weight ``normal_(0, init_std)``."""
    emb = skip_init(nn.Embedding, vocab, hidden)
    with torch.no_grad():
        emb.weight.normal_(0.0, init_std)
    return emb


def plain_lm_head(hidden: int, vocab: int, init_std: float, tied: Optional[nn.Embedding] = None) -> nn.Linear:
    """Bias-free vocabulary head [vocab, hidden]: draws ``normal_(0, init_std)``, or, with ``tied``
    (an embedding of the same shape), shares its weight and draws nothing."""
    head = skip_init(nn.Linear, hidden, vocab, bias=False)
    if tied is not None:
        head.weight = tied.weight
    else:
        with torch.no_grad():
            head.weight.normal_(0.0, init_std)
    return head
