"""Hugging Face weights into a plain gridshard Transformer, for tests: the by-name import that
checks the rename of :mod:`gridshard.models.hf` on a whole model (training reads Hugging Face
weights into a laid-out model with :func:`gridshard.checkpoint.hf_io.load_hf_blocks`)."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..models.hf import hf_to_gridshard_name


def load_hf_weights(model: torch.nn.Module, state: dict, strict: bool = True) -> None:
    """Copy a Hugging Face state dict (e.g. ``safetensors.torch.load_file(path)``) into a
    plain gridshard Transformer built on CPU (before ``parallelize``) by name."""
    own = model.state_dict()
    renamed = {hf_to_gridshard_name(k): v for k, v in state.items() if "rotary_emb" not in k}
    missing = sorted(set(own) - set(renamed))
    unexpected = sorted(set(renamed) - set(own))
    if strict and (missing or unexpected):
        raise ConfigError(f"Hugging Face weights do not match the model: missing {missing[:5]}, unexpected "
                          f"{unexpected[:5]}. Fix: build the model from the same config.")
    for k, v in renamed.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise ConfigError(f"Hugging Face weight {k!r} has shape {tuple(v.shape)}, the model expects "
                              f"{tuple(own[k].shape)}. Fix: build the model from the same config.")
    model.load_state_dict({k: v for k, v in renamed.items() if k in own}, strict=False)
