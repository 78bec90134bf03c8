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


def check_declared_output(declared: torch.Tensor, out: torch.Tensor, stage: str) -> None:
    """A stage's output as declared to its ``PipelineStage`` (``output_args``: what the next stage
    allocates to receive it, or the last stage's logits) against one it produced. torch 2.11's stage
    compares dtype, shape and stride of every forward output with the declaration and stops the run on
    a difference; 2.13 does not, and a send of another dtype than the receiver's buffer then fills part
    of it. So a wrong declaration fails here, on every torch and in the CPU tests."""
    want = (declared.dtype, tuple(declared.shape), declared.stride())
    got = (out.dtype, tuple(out.shape), out.stride())
    if want != got:
        raise RuntimeError(f"pipeline {stage} produced (dtype, shape, stride) {got} but was declared to produce "
                           f"{want}; the stages would disagree on the bytes sent. This is a gridshard bug: please "
                           f"report it with the config.")


class StageModule(nn.Module):
    def __init__(self, rank_model, layer_ids: Sequence[int], first: bool, last: bool, seq_len: int,
                 declared: torch.Tensor | None = None):
        """``declared``: the output described to the stage's ``PipelineStage`` (meta), checked against
        the first real one (:func:`check_declared_output`)."""
        super().__init__()
        self.first, self.last, self.seq_len, self.declared = first, last, seq_len, declared
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
        # the last stage's logits; else sent to the next stage (SP activations are stored sequence-first)
        out = self.head(x) if self.last else x.contiguous()
        if self.declared is not None:
            check_declared_output(self.declared, out, "last stage's logits" if self.last else "stage output")
            self.declared = None
        return out
