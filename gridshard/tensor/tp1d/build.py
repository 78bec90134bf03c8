"""The 1D layer of each plan kind (Megatron column/row; the ViT's replicated pieces)."""
from __future__ import annotations

from ...errors import LayoutError
from .classifier import Classifier1D
from .embedding import VocabParallelEmbedding, padded_vocab_size
from .linear import ColumnParallelLinear, RowParallelLinear
from .layer_norm import LayerNorm
from ...nn.norm import RMSNorm
from ..layer_build import META, head_dims, linear_dims as _linear_dims, norm_eps


def build_1d(name, module, kind, mesh, sp: bool, sp_in_embedding: bool, kv_replicate: int,
             overlap_input_grad: bool = True, tied_embedding=None):
    """The 1D layer for ``kind``: ``sp`` is sequence parallelism *in effect* (decided by the job
    layout's rule), ``overlap_input_grad`` goes to every column layer (the vocabulary head too); a
    vocabulary head tied to ``tied_embedding`` (a VocabParallelEmbedding) is built on its weight."""
    if kind in ("column", "kv_column"):
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return ColumnParallelLinear(n_in, n_out, mesh, bias=bias, gather_output=False, sequence_parallel=sp,
                                    device=META, replicate=kv_replicate if kind == "kv_column" else 1,
                                    overlap_input_grad=overlap_input_grad)
    if kind == "row":
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return RowParallelLinear(n_in, n_out, mesh, bias=bias, input_is_parallel=True, sequence_parallel=sp,
                                 device=META)
    if kind == "vocab_embedding":
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, mesh,
                                      sequence_parallel=sp and sp_in_embedding, device=META)
    if kind == "vocab_head":
        n_in, vocab = head_dims(name, module, "the vocab-parallel head")
        shared = tied_embedding.weight if tied_embedding is not None else None   # tied: one parameter, one spec
        return ColumnParallelLinear(n_in, padded_vocab_size(vocab, mesh.tensor.size), mesh, bias=False,
                                    gather_output=False, sequence_parallel=sp, device=META,
                                    overlap_input_grad=overlap_input_grad, canonical_out=vocab, shared_weight=shared)
    if kind == "norm":
        return RMSNorm(module.weight.shape[0], norm_eps(module), mesh, sequence_parallel=sp, device=META)
    return _build_vit_1d(name, module, kind, mesh, sp)


def _build_vit_1d(name, module, kind, mesh, sp: bool):
    """The ViT kinds in 1D: the patch embedding stays replicated (its docstring says why), LayerNorm
    and the class-token classifier are replicated layers aware of sequence parallelism."""
    if kind == "patch_embedding":
        return module
    if kind == "layer_norm":
        return LayerNorm(module.weight.shape[0], norm_eps(module), mesh, sequence_parallel=sp, device=META)
    if kind == "classifier":
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return Classifier1D(n_in, n_out, mesh, sequence_parallel=sp, bias=bias, device=META)
    raise LayoutError(f"parallelize: kind {kind!r} of {name!r} has no 1D layer")


