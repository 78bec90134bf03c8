"""Activation recompute: keep fewer activations for backward, compute them again instead.

``train.recompute``:

* ``none``: every activation a backward needs is kept.
* ``full``: each decoder layer keeps only its input; in backward its forward runs again
  (``torch.utils.checkpoint``, non-reentrant) and then its backward. The layer's
  tensor-parallel *forward* collectives therefore run twice per step (forward and
  recomputation: the same ops in the same order on every rank, so no rank waits on another);
  the step's tensor-group bytes grow by those forward collectives, up to the last tensor backward
  needs (PyTorch stops the recomputation there: :func:`gridshard.theory.tp1d.block_recompute_comm`).
* ``selective`` (Korthikanti et al. 2022): only the attention core — RoPE and the softmax
  attention, whose activations grow with s² per head while their FLOPs are small next to
  the projections — is recomputed; the projections, norms and MLP keep their activations.
  The core runs on each rank's own heads with no collective, so nothing is communicated
  again. (gridshard's model; a Hugging Face model takes ``full``.)

Both give exactly the same gradients as ``none`` (the recomputation repeats deterministic
fp32 ops; no dropout), which ``tests/test_recompute.py`` checks bit for bit.
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import LayoutError
from .decoder_layers import decoder_layers

MODES = ("none", "full", "selective")


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Install ``mode`` on a (laid-out or plain) model; returns how many modules it wraps."""
    if mode not in MODES:
        raise LayoutError(f"train.recompute={mode!r} is not one of {MODES}. Fix: use one of them.")
    count = 0
    if mode == "full":
        for _, module in decoder_layers(model):
            module.forward = _checkpointed(module.forward)
            count += 1
    elif mode == "selective":
        from ..models.llama import Attention

        for module in model.modules():
            if isinstance(module, Attention):
                module.recompute_core = True
                count += 1
        if count == 0:
            raise LayoutError(f"train.recompute=selective recomputes the attention core of gridshard's model, and "
                              f"this {type(model).__name__} has none. Fix: train.recompute=full.")
    return count
