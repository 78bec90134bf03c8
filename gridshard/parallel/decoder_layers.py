"""Which modules of a model are its decoder (encoder) layers, the units of recompute, compile and
ZeRO: ``layers.N`` (gridshard's Transformer), ``model.layers.N`` (Hugging Face Llama family) and
``vit.encoder.layer.N`` (gridshard's VisionTransformer, Hugging Face ``ViTForImageClassification``
names). A pipeline rank model keeps these names (its layers under their global N)."""
from __future__ import annotations

import re

from torch import nn

DECODER_LAYER = re.compile(r"^((model\.)?layers|vit\.encoder\.layer)\.\d+$")


def decoder_layers(model: nn.Module):
    """(name, module) of every decoder layer of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if DECODER_LAYER.match(name)]
