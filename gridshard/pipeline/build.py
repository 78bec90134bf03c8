"""Build this rank's part of the plain model for a pipeline layout (before ``parallelize``)."""
from __future__ import annotations

from .split import RankModel, stage_layer_counts, stage_layer_ids, stages_of_rank


def pipeline_rank_model(plain, mesh, parallel) -> RankModel:
    """The :class:`RankModel` of this pipeline rank: the layers of its stages (and the
    embedding / norm + head where it has the first / last stage), from ``plain`` on meta."""
    P, V = mesh.pipeline.size, parallel.virtual_stages
    S = P * V
    ids = stage_layer_ids(stage_layer_counts(plain.cfg.layers, S, parallel.stage_layers))
    mine = stages_of_rank(mesh.pipeline.rank, P, V)
    layer_ids = [i for s in mine for i in ids[s]]
    return RankModel(plain, layer_ids, has_first=0 in mine, has_last=(S - 1) in mine)
