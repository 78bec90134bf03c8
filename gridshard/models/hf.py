"""Hugging Face Llama-family models (Llama, Mistral, Qwen2 layouts): build from a config,
read their dimensions, and move weights by name.

``transformers`` is optional (``pip install gridshard[hf]``); it is imported only inside the
functions that need it (here, :mod:`gridshard.models.hf_stages` for its causal mask and
:mod:`gridshard.models.vit` for ``ViTConfig``), never at module level. Nothing is downloaded: the architecture comes from a
local ``config.json``.

Names: gridshard's :class:`gridshard.models.Transformer` uses Hugging Face's module names
without the ``model.`` prefix (``embed_tokens``, ``layers.N.self_attn.q_proj``, …,
``norm``; ``lm_head`` at the top in both), and every parameter has the same canonical
shape, so moving weights either way is the rename :func:`hf_to_gridshard_name` /
:func:`gridshard_to_hf_name`, never a reshape. Weights are read into a laid-out model by
:func:`gridshard.checkpoint.hf_io.load_hf_blocks` (``model.init_from``) and written by
``gridshard export`` (:func:`export_hf_state_dict`).
"""
from __future__ import annotations

import json

import torch

from ..errors import ConfigError
from .llama import ModelConfig


def _need_transformers():
    try:
        import transformers  # noqa: F401 (availability check)
    except ImportError:
        raise ConfigError("model.hf_config needs the optional Hugging Face dependency. Fix: "
                          "pip install -e .[hf]  (installs transformers and safetensors).") from None


def read_hf_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"model.hf_config={path!r} cannot be read ({e.strerror}). Fix: point it at a "
                          f"Hugging Face config.json on this machine.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.hf_config={path!r} is not valid JSON ({e}). Fix: use a config.json.") from None


# :class:`ModelConfig` field → Hugging Face ``config.json`` key, and the value a config that
# lacks the key means (None: the key is required): the one mapping, read here and written by
# :func:`gridshard.checkpoint.hf_io.hf_llama_config`
HF_CONFIG_KEYS = {"vocab_size": ("vocab_size", None), "hidden": ("hidden_size", None),
                  "layers": ("num_hidden_layers", None), "heads": ("num_attention_heads", None),
                  "kv_heads": ("num_key_value_heads", 0), "ffn_hidden": ("intermediate_size", None),
                  "max_seq_len": ("max_position_embeddings", 2048), "norm_eps": ("rms_norm_eps", 1e-6),
                  "rope_theta": ("rope_theta", 10000.0), "tie_embeddings": ("tie_word_embeddings", False),
                  "init_std": ("initializer_range", 0.02)}


def model_config_of_hf_json(path: str) -> ModelConfig:
    """The dimensions of a Hugging Face Llama-family config as a :class:`ModelConfig` (used for
    validation, FLOPs and parameter counts; the model itself is Hugging Face's)."""
    c = read_hf_json(path)
    try:
        dims = {field: c[key] if default is None else c.get(key, default)
                for field, (key, default) in HF_CONFIG_KEYS.items()}
        return ModelConfig(**{**dims, "kv_heads": dims["kv_heads"] or None,
                              "tie_embeddings": bool(dims["tie_embeddings"])})
    except KeyError as e:
        raise ConfigError(f"model.hf_config={path!r} lacks {e.args[0]!r}: gridshard reads Llama-family configs "
                          f"(hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size). "
                          f"Fix: use a Llama/Mistral/Qwen2 config.json.") from None


def build_hf_causal_lm(path_or_config, device="meta"):
    """``AutoModelForCausalLM.from_config`` on ``device`` (meta: no memory, no values; the
    values come from :func:`gridshard.parallelize`), SDPA attention, no download."""
    _need_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(path_or_config, str):
        fields = read_hf_json(path_or_config)
        config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    else:
        config = path_or_config
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def hf_to_gridshard_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` → ``layers.0.mlp.up_proj.weight``."""
    return name[len("model."):] if name.startswith("model.") else name


def gridshard_to_hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def export_hf_state_dict(state: dict) -> dict:
    """A canonical gridshard state dict (e.g. :func:`gridshard.gathered_state_dict`) under
    Hugging Face names, ready for ``safetensors.torch.save_file``."""
    return {gridshard_to_hf_name(k): v.contiguous() for k, v in state.items()}
