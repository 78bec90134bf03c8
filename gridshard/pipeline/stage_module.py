"""One pipeline stage as a module: what ``torch.distributed.pipelining.PipelineStage`` runs.

Stage s of S runs the model family's own forward pieces (:mod:`gridshard.pipeline.split`:
the ones its single-device forward is composed of) on this rank's tensor-parallel layout
(activations as the tensor mode holds them: [b, s, h] in 1D, [b, s/T, h] under sequence
parallelism, [b/q, s, h/q] in 2D)::

    first stage:  x = embed(tokens)
    every stage:  inputs = layer_inputs(x, s[, document ids])         (RoPE tables / positions and mask of length s)
                  x = run_layer(layer_i, x, inputs) for i in its layers
    last stage:   logits = head(x)                                     (this rank's logits block)

It registers only the modules this stage calls (so the schedule sees exactly its parameters;
they belong to the rank's laid-out model, which owns them) and adds no parameters of its own.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class StageModule(nn.Module):
    def __init__(self, rank_model, layer_ids: Sequence[int], first: bool, last: bool, seq_len: int):
        super().__init__()
        self.first, self.last, self.seq_len = first, last, seq_len
        self.held = nn.ModuleList(rank_model.stage_modules(layer_ids, first, last))
        self.layers = [rank_model.decoder_layer(i) for i in layer_ids]      # in self.held already
        # the family's pieces, bound to the rank model (plain attributes: nothing registered twice)
        self.embed, self.layer_inputs = rank_model.embed, rank_model.layer_inputs
        self.run_layer, self.head = rank_model.run_layer, rank_model.head

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: the micro-batch's document ids of packed windows (every stage gets them
        from the schedule; its layers' inputs are built from them, :meth:`Transformer.layer_inputs`)."""
        if self.first:
            x = self.embed(x)
        inputs = self.layer_inputs(x, self.seq_len) if documents is None else \
            self.layer_inputs(x, self.seq_len, documents)
        for layer in self.layers:
            x = self.run_layer(layer, x, inputs)
        if self.last:
            return self.head(x)
        return x.contiguous()      # sent to the next stage: SP activations are stored sequence-first
