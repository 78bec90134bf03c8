"""The reference model, written once and laid out by a tensor-parallel style."""
from .llama import Attention, ModelConfig, SwiGLUMLP, Transformer, TransformerBlock

__all__ = ["Attention", "ModelConfig", "SwiGLUMLP", "Transformer", "TransformerBlock"]
