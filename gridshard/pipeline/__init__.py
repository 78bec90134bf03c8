"""Pipeline parallelism: layers split into stages on the mesh's pipeline dimension, run by
``torch.distributed.pipelining`` schedules, composed with every tensor mode and data
parallelism. See ``docs/pipeline.md``."""
from .build import pipeline_rank_model
from .runner import SCHEDULES, PipelineRunner
from .split import HFRankModel, RankModel
from .tied import TiedEmbeddingSync

__all__ = ["HFRankModel", "PipelineRunner", "RankModel", "SCHEDULES", "TiedEmbeddingSync", "pipeline_rank_model"]
