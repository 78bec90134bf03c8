"""Memory per rank: model state by ZeRO stage, activations by tensor mode and recompute.

Arithmetic over shapes (no process groups, no tensors). The shapes of a rank's parameter
blocks are not described here: they are read from the layouts of the model laid out on the
meta device (:func:`gridshard.parallel.rank_blocks.rank_parameter_blocks`) and handed to
:func:`predict_rank_memory` by its caller (``theory`` imports no model code). The planner and the trainer's
``predicted_mem_bytes`` call these functions; ``tests/test_memory_model.py`` asserts them
against the tensors a real laid-out model holds.

Notation: h hidden, H heads, K kv heads, d = h/H, f MLP width, V vocabulary (V_p padded
to the tensor split), L layers, b micro-batch, s sequence, N = b·s tokens of a tensor
group's micro-batch, T tensor size (q = √T in 2D), D data size, P pipeline stages.

The model is in three modules, one per section of it: §1 model state by ZeRO stage
(:mod:`.model_state`), §2 activations by tensor mode and recompute (:mod:`.activations`; a Vision
Transformer's: :mod:`.vision`), §3 the
prediction of a rank's peak (:mod:`.predict`). This package re-exports their names.
"""
from .activations import (ActivationBytes, RankShape, activation_bytes, activation_element_bytes,
                          embedding_saved_bytes, head_and_loss_saved_bytes, layer_saved_bytes, layer_saved_tensors,
                          logits_workspace_bytes, norm_saved_bytes, weight_copy_bytes)
from .vision import is_vision, vit_activation_terms, vit_layer_saved_tensors
from .model_state import (ADAM_STATES, FP32, INDEX_BYTES, MASK_BYTES, STEP_COUNTER_BYTES, ModelState, ParamBlock,
                          kv_replica_grad_extra, model_state_bytes, param_element_bytes, zero_accumulator_bytes,
                          zero_gradient_transient, zero_reduce_cast_bytes, zero_units)
from .predict import RankMemory, predict_rank_memory

__all__ = ["ParamBlock", "kv_replica_grad_extra", "ModelState", "model_state_bytes", "zero_gradient_transient",
           "zero_reduce_cast_bytes", "zero_accumulator_bytes",
           "param_element_bytes",
           "zero_units",
           "ActivationBytes", "activation_bytes", "activation_element_bytes", "layer_saved_bytes",
           "layer_saved_tensors", "norm_saved_bytes",
           "weight_copy_bytes", "embedding_saved_bytes",
           "head_and_loss_saved_bytes", "logits_workspace_bytes", "RankMemory", "predict_rank_memory",
           "is_vision", "vit_activation_terms", "vit_layer_saved_tensors"]
