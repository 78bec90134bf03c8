"""Which modules of a model are its decoder (encoder) layers, the units of recompute, compile and
ZeRO: ``layers.N`` (gridshard's Transformer), ``model.layers.N`` (Hugging Face Llama family) and
``vit.encoder.layer.N`` (gridshard's VisionTransformer, Hugging Face ``ViTForImageClassification``
names). A pipeline rank model keeps these names (its layers under their global N)."""
from __future__ import annotations

import re
from typing import Optional, Tuple

from torch import nn

_LAYERS = r"^(?:(?:model\.)?layers|vit\.encoder\.layer)\.(\d+)"
DECODER_LAYER = re.compile(_LAYERS + "$")
LAYER_PARAMETER = re.compile(_LAYERS + r"\.")


def decoder_layers(model: nn.Module):
    """(name, module) of every decoder layer of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if DECODER_LAYER.match(name)]


def layer_parameter(name: str) -> Optional[Tuple[int, str]]:
    """(layer index N, name within the layer) of a decoder layer's parameter name, or None for a
    parameter outside the decoder layers."""
    m = LAYER_PARAMETER.match(name)
    return None if m is None else (int(m.group(1)), name[m.end():])
