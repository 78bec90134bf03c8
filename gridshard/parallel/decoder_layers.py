"""Which modules of a model are its decoder layers: ``layers.N`` (gridshard's model) or
``model.layers.N`` (Hugging Face Llama-family), the units of recompute, compile and ZeRO."""
from __future__ import annotations

import re

from torch import nn

DECODER_LAYER = re.compile(r"^(model\.)?layers\.\d+$")


def decoder_layers(model: nn.Module):
    """(name, module) of every decoder layer of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if DECODER_LAYER.match(name)]
