"""Build the gridshard layer that replaces one plain module, for one plan kind and tensor mode.

Every layer is built on ``device="meta"`` (no values, no random draws): the parameters
are materialised afterwards from the plain model's own tensors or the initialisation
laws (:mod:`gridshard.parallel.materialize`). Each built parameter carries its
:class:`gridshard.nn.sharding.ShardSpec`, whose canonical shape is the plain module's.
"""
from __future__ import annotations

from torch import nn

from ..errors import LayoutError
from ..nn.classifier_1d import Classifier1D
from ..nn.classifier_2d import ClsClassifier2D, TiedVocabHead2D, VocabParallelClassifier2D
from ..nn.embedding_1d import VocabParallelEmbedding, padded_vocab_size
from ..nn.embedding_2d import VocabParallelEmbedding2D
from ..nn.linear_1d import ColumnParallelLinear, RowParallelLinear
from ..nn.linear_2d import Linear2D
from ..nn.layer_norm import LayerNorm
from ..nn.norm import RMSNorm
from ..nn.norm_2d import LayerNorm2D, RMSNorm2D
from ..nn.patch_embedding_2d import ViTEmbeddings2D

META = "meta"


def _linear_dims(name: str, module: nn.Module, kind: str):
    if not isinstance(module, nn.Linear):
        raise LayoutError(f"parallelize: module {name!r} ({type(module).__name__}) is planned as {kind!r}, which "
                          f"replaces an nn.Linear. Fix: map it to another kind in the plan, or to 'replicate'.")
    return module.in_features, module.out_features, module.bias is not None


def norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    return 1e-6 if eps is None else float(eps)


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
        n_in, vocab, bias = _linear_dims(name, module, kind)
        if bias:
            raise LayoutError(f"parallelize: the vocabulary head {name!r} has a bias, which the vocab-parallel "
                              f"head does not support. Fix: build the head with bias=False.")
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


def build_2d(name, module, kind, mesh, tied_embedding=None, overlap: bool = True, vector_cache=None):
    """The 2D layer for ``kind``: ``overlap`` for the SUMMA products, ``vector_cache`` (the model's
    :class:`gridshard.comm.grid_ops.GatheredVectors`) for the layers that gather biases or norm weights."""
    if kind in ("column", "kv_column", "row"):
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return Linear2D(n_in, n_out, mesh, bias=bias, device=META, overlap=overlap, vector_cache=vector_cache)
    if kind == "vocab_embedding":
        return VocabParallelEmbedding2D(module.num_embeddings, module.embedding_dim, mesh, device=META)
    if kind == "vocab_head":
        n_in, vocab, bias = _linear_dims(name, module, kind)
        if bias:
            raise LayoutError(f"parallelize: the vocabulary head {name!r} has a bias, which the 2D vocab head does "
                              f"not support. Fix: build the head with bias=False.")
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


def build_3d(name, module, kind, mesh, tied_embedding=None, vector_cache=None):
    """The 3D layer for ``kind`` on ``mesh`` (the job mesh's ``cube``, the residual stream's
    orientation): a column projection (q|k|v, gate, up) reads the residual layout and writes the
    swapped one (heads / neurons block j = my input coordinate, batch block i·q + l), so the
    attention core and the SwiGLU product run on whole heads and neurons of that layout; a row
    projection (o, down) is built on ``mesh.swapped()`` and writes the residual layout back; norms
    and the embedding live on the residual orientation; the head reads it and writes logits in
    the swapped one (:class:`gridshard.nn.linear_3d.VocabParallelClassifier3D`, or tied to the
    embedding's table: :class:`gridshard.nn.tied_head_3d.TiedVocabHead3D`)."""
    from ..nn.embedding_3d import VocabParallelEmbedding3D
    from ..nn.linear_3d import Linear3D, VocabParallelClassifier3D
    from ..nn.norm_3d import RMSNorm3D
    from ..nn.tied_head_3d import TiedVocabHead3D

    if kind in ("column", "kv_column", "row"):
        n_in, n_out, bias = _linear_dims(name, module, kind)
        on = mesh.swapped() if kind == "row" else mesh
        return Linear3D(n_in, n_out, on, bias=bias, device=META, vector_cache=vector_cache)
    if kind == "vocab_embedding":
        return VocabParallelEmbedding3D(module.num_embeddings, module.embedding_dim, mesh, device=META)
    if kind == "vocab_head":
        n_in, vocab, bias = _linear_dims(name, module, kind)
        if bias:
            raise LayoutError(f"parallelize: the vocabulary head {name!r} has a bias, which the 3D vocab head does "
                              f"not support. Fix: build the head with bias=False.")
        if tied_embedding is not None:
            return TiedVocabHead3D(tied_embedding)
        return VocabParallelClassifier3D(n_in, vocab, mesh, device=META)
    if kind == "norm":
        return RMSNorm3D(module.weight.shape[0], mesh, norm_eps(module), device=META, vector_cache=vector_cache)
    if kind in ("patch_embedding", "layer_norm", "classifier"):     # the ViT (H3): gridshard/nn/vision_3d.py
        return _vit_3d(name, module, kind, mesh, vector_cache)
    raise LayoutError(f"parallelize: kind {kind!r} of {name!r} cannot be laid out in 3D (3D is built for "
                      f"gridshard's and Hugging Face's Llama: column/kv_column/row/norm/vocab_embedding/vocab_head; "
                      f"the residual stream is split over the cube, so a replicated module would see a block, not "
                      f"its whole input). Fix: use tensor_mode 2d or 1d for this model, or map {name!r} to one of "
                      f"those kinds.")


def _vit_3d(name, module, kind, mesh, vector_cache=None):
    """The ViT's own kinds at 3D, all on the residual orientation ``mesh``: its embeddings
    (:class:`gridshard.nn.vision_3d.ViTEmbeddings3D`: images of batch block i·q + j → tokens in the
    residual layout), LayerNorm3D, and the class-token head
    (:class:`gridshard.nn.vision_3d.ClsClassifier3D`: full logits of batch block i·q + j)."""
    from ..nn.norm_3d import LayerNorm3D
    from ..nn.vision_3d import ClsClassifier3D, ViTEmbeddings3D

    if kind == "layer_norm":
        return LayerNorm3D(module.weight.shape[0], mesh, norm_eps(module), device=META, vector_cache=vector_cache)
    if kind == "classifier":
        n_in, n_out, bias = _linear_dims(name, module, kind)
        return ClsClassifier3D(n_in, n_out, mesh, bias=bias, device=META)
    conv = module.patch_embeddings.projection
    return ViTEmbeddings3D(module.image_size, conv.kernel_size[0], conv.in_channels, conv.out_channels, mesh,
                           device=META)
