"""From a plain model to a laid-out one: plans, ``parallelize``, canonical state dicts."""
from .model_context import ParallelContext, context_of
from .parallelize import ModelDims, check_layout, model_dims, parallelize
from .plan import HF_LLAMA_PLAN, LLAMA_PLAN, VIT_PLAN, Plan
from .state_dict import gather_canonical, gathered_state_dict
from .dtensor_view import placements_of

__all__ = ["ParallelContext", "context_of", "ModelDims", "check_layout", "model_dims", "parallelize",
           "HF_LLAMA_PLAN", "LLAMA_PLAN", "VIT_PLAN", "Plan", "gather_canonical", "gathered_state_dict",
           "placements_of"]
