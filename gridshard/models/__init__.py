"""The plain single-device models, written once; :func:`gridshard.parallelize` lays them out.

Three families: gridshard's decoder (:mod:`.llama`, exported here, with :mod:`.presets` and
:mod:`.rope`), a ViT classifier (:mod:`.vit`) and Hugging Face Llama-family causal LMs, built
from their own config (:mod:`.hf`; :mod:`.hf_stages` is their forward in pipeline pieces). The
composer picks the family (``gridshard.engine.job``; docs/architecture.md, "Model families")."""
from .llama import Attention, DecoderLayer, ModelConfig, SwiGLUMLP, Transformer

__all__ = ["Attention", "DecoderLayer", "ModelConfig", "SwiGLUMLP", "Transformer"]
