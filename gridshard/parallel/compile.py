"""``train.compile``: ``torch.compile`` of each decoder layer's forward.

Each decoder layer (``layers.N`` / ``model.layers.N`` / a ViT's ``vit.encoder.layer.N``, the units
recompute and ZeRO use: :mod:`gridshard.parallel.decoder_layers`) has
its ``forward`` replaced by ``torch.compile(forward)``; the module itself stays as it is, so
parameter names, state dicts, checkpoints, forward hooks (ZeRO-3's release and regather) and
recompute (whose hooks recompute the forward the call ran, here the compiled one, whether
recompute is applied before or after) are unchanged. One compiled graph serves every
layer: since torch 2.5 Dynamo treats a module's parameters as graph inputs, not constants
(``inline_inbuilt_nn_modules``), so the layers differ only in their inputs.

Why the forward and not ``nn.Module.compile``: that compiles the module's whole ``__call__``,
its hooks included — ZeRO-3's gather and release, recompute's checkpoint region — and full
recompute can then only re-run the eager forward, whose saved tensors differ from the compiled
call's (torch 2.13: ``CheckpointError``, "recomputed values ... have different metadata"). The
compiled forward keeps the hooks eager and the recomputation identical to the forward.

gridshard's tensor-parallel collectives are autograd Functions that call
``torch.distributed`` and record into the ledger (Python side effects Dynamo does not
trace): each one is a graph break, and Dynamo compiles the pieces between them (norms,
rotary embedding, attention core, activations, residual adds) and runs the collectives
eagerly, so the ledger and every rank's order of collectives are the same as without
compile. A single-device layer (``parallel.tensor: 1``) has no collective and compiles
whole. ``tests/test_compile.py`` checks losses against eager; ``benchmarks/bench_compile.py``
measures the step-time ratio.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm.collectives import compile_eagerly
from .decoder_layers import decoder_layers


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer's forward of ``model`` in place; returns how many. Before or
    after :func:`gridshard.parallel.recompute.apply_recompute` alike: full recompute re-runs the
    forward a call ran, the compiled one."""
    compile_eagerly()
    layers = decoder_layers(model)
    for _, module in layers:
        module.forward = torch.compile(module.forward, backend=backend)
    return len(layers)
