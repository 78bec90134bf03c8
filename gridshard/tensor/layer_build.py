"""Shared pieces of building a mode's layer for one plan kind (:meth:`TensorScheme.build_layer`).

Every layer is built on ``device="meta"`` (no values, no random draws): the parameters
are materialised afterwards from the plain model's own tensors or the initialisation
laws (:mod:`gridshard.parallel.materialize`). Each built parameter carries its
:class:`gridshard.nn.sharding.ShardSpec`, whose canonical shape is the plain module's.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import LayoutError

META = "meta"


@dataclass(frozen=True)
class LayerBuild:
    """The facts and options every layer of one ``parallelize`` call is built with: ``mesh``;
    ``sequence_parallel`` *in effect* (the job layout's rule) and whether the plan scatters the
    sequence in the embedding (``sp_in_embedding``); ``kv_replication`` (1D: ranks sharing a kv
    head); ``overlap_input_grad`` (1D column layers); ``summa_overlap`` (2D products); and the
    model's one ``vector_cache`` (:class:`gridshard.comm.grid_ops.GatheredVectors`)."""

    mesh: object
    sequence_parallel: bool = False
    sp_in_embedding: bool = False
    kv_replication: int = 1
    overlap_input_grad: bool = True
    summa_overlap: bool = True
    vector_cache: object = None


def linear_dims(name: str, module: nn.Module, kind: str):
    if not isinstance(module, nn.Linear):
        raise LayoutError(f"parallelize: module {name!r} ({type(module).__name__}) is planned as {kind!r}, which "
                          f"replaces an nn.Linear. Fix: map it to another kind in the plan, or to 'replicate'.")
    return module.in_features, module.out_features, module.bias is not None


def head_dims(name: str, module: nn.Module, head: str):
    """(in_features, vocabulary) of a vocabulary head; ``head`` names the mode's head in the refusal of a bias."""
    n_in, vocab, bias = linear_dims(name, module, "vocab_head")
    if bias:
        raise LayoutError(f"parallelize: the vocabulary head {name!r} has a bias, which {head} does not support. "
                          f"Fix: build the head with bias=False.")
    return n_in, vocab


def norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    return 1e-6 if eps is None else float(eps)
