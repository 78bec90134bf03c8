"""A Hugging Face Llama-family causal LM's forward in the pieces a pipeline stage runs.

``LlamaForCausalLM.forward(input_ids, use_cache=False)`` (transformers 5.x ``LlamaModel.forward``
with no cache, no padding mask and no given positions) is, on tokens [b, s]::

    embed          x = model.embed_tokens(tokens)
    layer_inputs   position_ids = [[0, 1, …, s−1]]
                   mask = create_causal_mask(config, inputs_embeds of shape [b, s, ·], None, None, position_ids)
                        (None under SDPA: its is_causal path)
                   position_embeddings = (cos, sin) = model.rotary_emb(x, position_ids)
    run_layer      x = layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=position_ids)
    head           logits = lm_head(model.norm(x))

:class:`LlamaStagePieces` is that list over the model's own modules, under Hugging Face's
names (``model.embed_tokens``, ``model.rotary_emb``, ``model.layers.N``, ``model.norm``,
``lm_head``): a pipeline stage calls exactly the modules and arguments the single-device
forward does. Positions and the mask are those of the whole sequence (``seq_len``), since a
stage's input may be a block of it (sequence parallelism) or arrive from another stage. Under
context parallelism (``split_sequence``) the positions are the rank's two chunks' global ones and
the mask is None (:data:`gridshard.models.hf.CONTEXT_ATTENTION` is causal by global position).
``tests/test_hf_pipeline.py`` checks that the pieces composed over a whole model give Hugging
Face's own logits bit for bit, and that pipelined runs equal one process.

Families whose forward differs (a sliding-window mask: Mistral's ``sliding_window``, Qwen2's
``use_sliding_window``) are refused by :func:`check_stageable` (config validation, before
launch, and the rank model): their stages would need that mask, which these pieces do not build.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .hf import position_ids as hf_position_ids
from .hf import sliding_window_in_effect    # a config reader (hf.py); gridshard.config.validate imports it from here


def check_stageable(fields: dict) -> None:
    """ConfigError unless every layer of this Hugging Face config (``config.json``'s fields, or
    ``config.to_dict()``) attends with the plain causal mask."""
    model_type, sliding = fields.get("model_type", "llama"), sliding_window_in_effect(fields)
    if sliding is not None:
        raise ConfigError(f"model.hf_config: model_type={model_type!r} with sliding_window={sliding} attends through "
                          f"a sliding-window mask, and gridshard's pipeline stages run the plain causal mask of "
                          f"Llama's forward. Fix: parallel.pipeline=1, or sliding_window: null in the config.json.")


class LlamaStagePieces:
    """The forward's pieces (module docstring) over ``self.model.{embed_tokens, rotary_emb, norm}``,
    ``self.lm_head`` and ``self.config`` — a whole Hugging Face model's modules or one pipeline
    rank's (:class:`gridshard.pipeline.split.HFRankModel`)."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    #: (C, context rank) of the tokens these pieces see; (1, 0): whole sequences (:meth:`split_sequence`)
    context_split: tuple = (1, 0)

    def split_sequence(self, context_size: int, context_rank: int) -> None:
        """Context parallelism: the pieces see context rank ``context_rank``'s 2c tokens of every
        sequence, so the positions are their global ones (set by ``gridshard.parallelize``)."""
        self.context_split = (context_size, context_rank)

    def layer_inputs(self, x: torch.Tensor, seq_len: int) -> dict:
        """The decoder layers' keyword arguments for a whole sequence of ``seq_len`` positions
        (under context parallelism: the rank's 2c tokens at their global positions, and no mask,
        :data:`gridshard.models.hf.CONTEXT_ATTENTION`)."""
        position_ids = hf_position_ids(seq_len, self.context_split, x.device)
        try:
            from transformers.masking_utils import create_causal_mask
        except ImportError:        # transformers < 4.53: no mask given means SDPA's is_causal path there
            mask = None
        else:
            shape_of_embeds = x.new_empty((x.shape[0], seq_len, 0))  # the mask reads batch, length, dtype, device
            mask = create_causal_mask(config=self.config, inputs_embeds=shape_of_embeds, attention_mask=None,
                                      past_key_values=None, position_ids=position_ids)
        return {"attention_mask": mask, "position_ids": position_ids,
                "position_embeddings": self.model.rotary_emb(x, position_ids=position_ids)}

    @staticmethod
    def run_layer(layer: nn.Module, x: torch.Tensor, inputs: dict) -> torch.Tensor:
        out = layer(x, **inputs)
        return out[0] if isinstance(out, tuple) else out    # transformers 4.x layers return (hidden, ...)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))
