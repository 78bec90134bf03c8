"""The reference model, written once and plainly; :func:`gridshard.parallelize` lays it out."""
from .llama import Attention, DecoderLayer, ModelConfig, SwiGLUMLP, Transformer

__all__ = ["Attention", "DecoderLayer", "ModelConfig", "SwiGLUMLP", "Transformer"]
