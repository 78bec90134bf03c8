"""Build this rank's part of the plain model for a pipeline layout (before ``parallelize``)."""
from __future__ import annotations

from ..errors import ConfigError
from ..models.llama import Transformer
from ..models.vit import VisionTransformer
from .split import HFRankModel, RankModel, ViTRankModel


def pipeline_rank_model(plain, mesh, split):
    """The rank model of this pipeline rank, by the plain model's family (gridshard's
    :class:`Transformer` → :class:`RankModel`; its :class:`VisionTransformer` →
    :class:`ViTRankModel`; a Hugging Face Llama-family causal LM →
    :class:`HFRankModel`): the layers of its stages (and the embedding / norm + head where it
    has the first / last stage), from ``plain`` on meta. ``split``: the job layout's
    :class:`gridshard.job_layout.StageSplit`."""
    from ..parallel.parallelize import HF_LLAMA_TYPES

    r = mesh.pipeline.rank
    parts = (split.rank_layer_ids(r), split.holds_first(r), split.holds_last(r))
    if isinstance(plain, Transformer):
        return RankModel(plain, *parts)
    if isinstance(plain, VisionTransformer):
        return ViTRankModel(plain, *parts)
    model_type = getattr(getattr(plain, "config", None), "model_type", None)
    if model_type in HF_LLAMA_TYPES:
        return HFRankModel(plain, *parts)
    raise ConfigError(f"parallel.pipeline={mesh.pipeline.size}: pipeline stages are built from gridshard's "
                      f"Transformer or VisionTransformer or a Hugging Face model of model_type in "
                      f"{HF_LLAMA_TYPES}, not a "
                      f"{type(plain).__name__} (model_type={model_type!r}). Fix: use one of those, or pipeline=1.")
