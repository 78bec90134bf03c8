"""The 3D layer of each plan kind (on the cube's residual orientation or the swapped one)."""
from __future__ import annotations

from ...errors import LayoutError
from .embedding import VocabParallelEmbedding3D
from .linear import Linear3D, VocabParallelClassifier3D
from .norm import LayerNorm3D, RMSNorm3D
from .tied_head import TiedVocabHead3D
from .vision import ClsClassifier3D, ViTEmbeddings3D
from ..layer_build import META, head_dims, linear_dims as _linear_dims, norm_eps


def build_3d(name, module, kind, mesh, tied_embedding=None, vector_cache=None):
    """The 3D layer for ``kind`` on ``mesh`` (the job mesh's ``cube``, the residual stream's
    orientation): a column projection (q|k|v, gate, up) reads the residual layout and writes the
    swapped one (heads / neurons block j = my input coordinate, batch block i·q + l), so the
    attention core and the SwiGLU product run on whole heads and neurons of that layout; a row
    projection (o, down) is built on ``mesh.swapped()`` and writes the residual layout back; norms
    and the embedding live on the residual orientation; the head reads it and writes logits in
    the swapped one (:class:`gridshard.tensor.tp3d.linear.VocabParallelClassifier3D`, or tied to the
    embedding's table: :class:`gridshard.tensor.tp3d.tied_head.TiedVocabHead3D`)."""
    if kind in ("column", "kv_column", "row"):
        n_in, n_out, bias = _linear_dims(name, module, kind)
        on = mesh.swapped() if kind == "row" else mesh
        return Linear3D(n_in, n_out, on, bias=bias, device=META, vector_cache=vector_cache)
    if kind == "vocab_embedding":
        return VocabParallelEmbedding3D(module.num_embeddings, module.embedding_dim, mesh, device=META)
    if kind == "vocab_head":
        n_in, vocab = head_dims(name, module, "the 3D vocab head")
        if tied_embedding is not None:
            return TiedVocabHead3D(tied_embedding)
        return VocabParallelClassifier3D(n_in, vocab, mesh, device=META)
    if kind == "norm":
        return RMSNorm3D(module.weight.shape[0], mesh, norm_eps(module), device=META, vector_cache=vector_cache)
    if kind in ("patch_embedding", "layer_norm", "classifier"):     # the ViT (H3): gridshard/tensor/tp3d/vision.py
        return _vit_3d(name, module, kind, mesh, vector_cache)
    raise LayoutError(f"parallelize: kind {kind!r} of {name!r} cannot be laid out in 3D (3D is built for "
                      f"gridshard's and Hugging Face's Llama: column/kv_column/row/norm/vocab_embedding/vocab_head; "
                      f"the residual stream is split over the cube, so a replicated module would see a block, not "
                      f"its whole input). Fix: use tensor_mode 2d or 1d for this model, or map {name!r} to one of "
                      f"those kinds.")


def _vit_3d(name, module, kind, mesh, vector_cache=None):
    """The ViT's own kinds at 3D, all on the residual orientation ``mesh``: its embeddings
    (:class:`gridshard.tensor.tp3d.vision.ViTEmbeddings3D`: images of batch block i·q + j → tokens in the
    residual layout), LayerNorm3D, and the class-token head
    (:class:`gridshard.tensor.tp3d.vision.ClsClassifier3D`: full logits of batch block i·q + j)."""
    if kind == "layer_norm":
        return LayerNorm3D(module.weight.shape[0], mesh, norm_eps(module), device=META, vector_cache=vector_cache)
    if kind == "classifier":
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return ClsClassifier3D(n_in, n_out, mesh, bias=bias, device=META)
    conv = module.patch_embeddings.projection
    return ViTEmbeddings3D(module.image_size, conv.kernel_size[0], conv.in_channels, conv.out_channels, mesh,
                           device=META)
