"""The 2D layer of each plan kind (SUMMA on the q×q grid)."""
from __future__ import annotations

from ...errors import LayoutError
from .classifier import ClsClassifier2D, TiedVocabHead2D, VocabParallelClassifier2D
from .embedding import VocabParallelEmbedding2D
from .linear import Linear2D
from .norm import LayerNorm2D, RMSNorm2D
from .patch_embedding import ViTEmbeddings2D
from ..layer_build import META, head_dims, linear_dims as _linear_dims, norm_eps


def build_2d(name, module, kind, mesh, tied_embedding=None, overlap: bool = True, vector_cache=None):
    """The 2D layer for ``kind``: ``overlap`` for the SUMMA products, ``vector_cache`` (the model's
    :class:`gridshard.comm.grid_ops.GatheredVectors`) for the layers that gather biases or norm weights."""
    if kind in ("column", "kv_column", "row"):
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return Linear2D(n_in, n_out, mesh, bias=bias, device=META, overlap=overlap, vector_cache=vector_cache)
    if kind == "vocab_embedding":
        return VocabParallelEmbedding2D(module.num_embeddings, module.embedding_dim, mesh, device=META)
    if kind == "vocab_head":
        n_in, vocab = head_dims(name, module, "the 2D vocab head")
        if tied_embedding is not None:
            return TiedVocabHead2D(tied_embedding, overlap=overlap)
        return VocabParallelClassifier2D(n_in, vocab, mesh, device=META, overlap=overlap, vector_cache=vector_cache)
    if kind == "norm":
        return RMSNorm2D(module.weight.shape[0], mesh, norm_eps(module), device=META, vector_cache=vector_cache)
    if kind == "layer_norm":
        return LayerNorm2D(module.weight.shape[0], mesh, norm_eps(module), vector_cache=vector_cache, device=META)
    if kind == "classifier":
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return ClsClassifier2D(n_in, n_out, mesh, bias=bias, device=META)
    if kind == "patch_embedding":
        conv = module.patch_embeddings.projection
        return ViTEmbeddings2D(module.image_size, conv.kernel_size[0], conv.in_channels, conv.out_channels, mesh,
                               device=META)
    raise LayoutError(f"parallelize: kind {kind!r} of {name!r} cannot be laid out in 2D (the residual stream is "
                      f"split over the grid, so a replicated module would see a block, not its whole input). "
                      f"Fix: map {name!r} to column/row/norm/vocab_* in the plan.")


