"""Build this rank's part of the plain model for a pipeline layout (before ``parallelize``)."""
from __future__ import annotations

from .split import RankModel


def pipeline_rank_model(plain, mesh, split) -> RankModel:
    """The :class:`RankModel` of this pipeline rank: the layers of its stages (and the
    embedding / norm + head where it has the first / last stage), from ``plain`` on meta.
    ``split``: the job layout's :class:`gridshard.job_layout.StageSplit`."""
    r = mesh.pipeline.rank
    return RankModel(plain, split.rank_layer_ids(r), has_first=split.holds_first(r), has_last=split.holds_last(r))
