"""One pipeline stage as a module: what ``torch.distributed.pipelining.PipelineStage`` runs.

Stage s of S computes, on this rank's tensor-parallel layout (activations as the tensor
mode holds them: [b, s, h] in 1D, [b, s/T, h] under sequence parallelism, [b/q, s, h/q]
in 2D)::

    first stage:  x = embed_tokens(tokens)
    every stage:  x = layer_i(x, cos, sin) for i in its layers          (RoPE tables of length s)
    last stage:   logits = lm_head(norm(x))                              (this rank's logits block)

It shares its modules with the rank's :class:`gridshard.pipeline.split.RankModel` (the
laid-out model that owns the parameters); it adds no parameters of its own.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models.rope import rope_tables


class StageModule(nn.Module):
    def __init__(self, rank_model, layer_ids: Sequence[int], first: bool, last: bool, seq_len: int):
        super().__init__()
        self.first, self.last, self.seq_len = first, last, seq_len
        self.head_dim, self.theta = rank_model.cfg.head_dim, rank_model.cfg.rope_theta
        if first:
            self.embed_tokens = rank_model.embed_tokens
        self.layers = nn.ModuleList(rank_model.layers[str(i)] for i in layer_ids)
        if last:
            self.norm, self.lm_head = rank_model.norm, rank_model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed_tokens(x)
        cos, sin = rope_tables(self.seq_len, self.head_dim, self.theta, device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.last:
            x = self.lm_head(self.norm(x))
            return x
        return x.contiguous()      # sent to the next stage: SP activations are stored sequence-first
