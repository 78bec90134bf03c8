"""Hugging Face Llama-family models (Llama, Mistral, Qwen2 layouts, and the Mixture-of-Experts
Mixtral, Qwen2-MoE and Qwen3-MoE): build from a config, read their dimensions, and move weights by name.

A Mixtral, Qwen2-MoE or Qwen3-MoE is built with gridshard's MoE block (:class:`gridshard.moe.layer.MoEBlock`)
in place of each of its sparse MoE blocks (:func:`use_our_moe_blocks`): the same parameters under
the same names (transformers 5: ``mlp.gate.weight``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) and the same routing (softmax top-k, normalised where the config says),
so its weights load as they are and its logits are transformers' own; the block brings expert
parallelism, the per-sequence aux loss and the statistics (docs/moe.md). A Qwen2-MoE's gated shared
expert is its own module, kept under its names (:meth:`~gridshard.moe.layer.MoEBlock.attach_shared`).

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

Context parallelism (``parallel.context`` C > 1): :func:`attend_over_context` makes the attention
modules attend through gridshard's ring or all-to-all (transformers' attention interface, no mask
built), and :func:`position_ids` gives the rotary embedding the chunks' global positions.
"""
from __future__ import annotations

import json

import torch

from ..errors import ConfigError, LayoutError, need_package
from .llama import ModelConfig


def _need_transformers():
    need_package("transformers", "model.hf_config needs the optional Hugging Face dependency. Fix: "
                 "pip install -e .[hf]  (installs transformers and safetensors).")


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


def sliding_window_in_effect(fields: dict):
    """The sliding window some layer of this Hugging Face config (``config.json``'s fields, or
    ``config.to_dict()``) attends through (Mistral's ``sliding_window``, Qwen2's with
    ``use_sliding_window``), or None: every layer attends with the plain causal mask."""
    model_type, sliding = fields.get("model_type", "llama"), fields.get("sliding_window")
    if sliding is not None and (model_type == "mistral" or fields.get("use_sliding_window", False)):
        return sliding
    return None


def hf_moe_fields(c: dict) -> dict:
    """The :class:`ModelConfig` MoE fields of a Hugging Face config's fields ({} for a dense one):
    Mixtral (every layer, normalised top-k) and Qwen3-MoE (layer i when (i+1) % decoder_sparse_step
    == 0, ``norm_topk_prob``); ConfigError for an MoE shape gridshard's block does not compute."""
    model_type = c.get("model_type")
    if model_type == "mixtral":
        return {"experts": c["num_local_experts"], "experts_per_token": c.get("num_experts_per_tok", 2),
                "expert_ffn_hidden": c["intermediate_size"]}
    if model_type == "qwen3_moe":
        if c.get("mlp_only_layers"):
            raise ConfigError(f"model.hf_config: mlp_only_layers={c['mlp_only_layers']} makes chosen layers dense, "
                              f"which gridshard's layer rule ((i+1) % moe_every == 0) cannot say. Fix: use "
                              f"decoder_sparse_step instead, or an empty mlp_only_layers.")
        experts = c["num_experts"] if "num_experts" in c else c["num_local_experts"]    # transformers 5 writes the latter
        return {"experts": experts, "experts_per_token": c.get("num_experts_per_tok", 8),
                "expert_ffn_hidden": c["moe_intermediate_size"], "moe_every": c.get("decoder_sparse_step", 1),
                "router_normalize": bool(c.get("norm_topk_prob", False))}
    if model_type == "qwen2_moe":                      # + a gated shared expert (MoEBlock.attach_shared)
        fields = hf_moe_fields({**c, "model_type": "qwen3_moe"})
        shared, width = c.get("shared_expert_intermediate_size", 0), fields["expert_ffn_hidden"]
        if shared % width:
            raise ConfigError(f"model.hf_config: shared_expert_intermediate_size={shared} is not a multiple of "
                              f"moe_intermediate_size={width}, which gridshard's parameter and FLOP counts assume "
                              f"(shared_experts = their ratio). Fix: use a multiple.")
        return {**fields, "shared_experts": shared // width}
    if model_type in ("deepseek_v3", "olmoe"):
        raise ConfigError(f"model.hf_config: model_type={model_type!r} is a Mixture-of-Experts shape gridshard's "
                          f"MoE block does not compute yet. Fix: use a Mixtral, Qwen2-MoE or Qwen3-MoE config, or "
                          f"gridshard's own model with model.experts.")
    return {}


def model_config_of_hf_json(path: str) -> ModelConfig:
    """The dimensions of a Hugging Face Llama-family config as a :class:`ModelConfig` (used for
    validation, FLOPs and parameter counts; the model itself is Hugging Face's)."""
    c = read_hf_json(path)
    try:
        dims = {field: c[key] if default is None else c.get(key, default)
                for field, (key, default) in HF_CONFIG_KEYS.items()}
        return ModelConfig(**{**dims, "kv_heads": dims["kv_heads"] or None,
                              "tie_embeddings": bool(dims["tie_embeddings"]), **hf_moe_fields(c)})
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
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        use_our_moe_blocks(model)
    return model


def use_our_moe_blocks(model) -> None:
    """Replace every sparse MoE block of a Hugging Face Mixtral / Qwen3-MoE ``model`` (built on the
    current device) by a :class:`gridshard.moe.layer.MoEBlock` of its config (module docstring)."""
    from ..moe.layer import MoEBlock

    moe = hf_moe_fields(model.config.to_dict())
    if not moe:
        return
    for i, layer in enumerate(model.model.layers):
        if type(layer.mlp).__name__.endswith("SparseMoeBlock"):
            block = MoEBlock(model.config.hidden_size, moe["experts"], moe["experts_per_token"],
                             moe["expert_ffn_hidden"], normalize=moe.get("router_normalize", True), layer=i)
            if getattr(layer.mlp, "shared_expert", None) is not None:        # Qwen2-MoE: its gated shared expert
                block.attach_shared(layer.mlp.shared_expert, layer.mlp.shared_expert_gate)
            layer.mlp = block


def hf_to_gridshard_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` → ``layers.0.mlp.up_proj.weight``."""
    return name[len("model."):] if name.startswith("model.") else name


def gridshard_to_hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def export_hf_state_dict(state: dict) -> dict:
    """A canonical gridshard state dict (e.g. :func:`gridshard.gathered_state_dict`) under
    Hugging Face names, ready for ``safetensors.torch.save_file``."""
    return {gridshard_to_hf_name(k): v.contiguous() for k, v in state.items()}


# ---- context parallelism (``parallel.context`` C > 1) -------------------------------------
#: the name gridshard's context attention is registered under in transformers' attention interface.
#: The mask interface does not know it, so ``create_causal_mask`` returns None on this path: no
#: s×s mask is built for the local chunks (whose positions are not contiguous); the context
#: attention is causal by global position itself.
CONTEXT_ATTENTION = "gridshard_context"


def _context_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                       **_):
    """transformers' attention-interface call → ``module.context_attention(q, k, v, scale=scaling)``.

    ``query`` [b, H, 2c, d], ``key``/``value`` [b, H_kv, 2c, d] (after RoPE at global positions) are
    this context rank's chunks; the result is the rank's rows of softmax(q·kᵀ·scaling + causal
    mask by global position)·v over the whole sequence, returned as Hugging Face's attention
    functions do: ([b, 2c, H, d], no weights)."""
    attend = getattr(module, "context_attention", None)
    if attend is None or attention_mask is not None or dropout or sliding_window is not None:
        raise LayoutError(f"{type(module).__name__} attends over the context axis only as gridshard.parallelize "
                          f"installs it: plain causal, no mask given (got {type(attention_mask).__name__}), no "
                          f"sliding window (got {sliding_window}), attention_dropout 0 (got {dropout}). Fix: call the "
                          f"model with input_ids and position_ids only; attention_dropout: 0.0 and no sliding window "
                          f"in the config.json.")
    return attend(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


def attend_over_context(model, attention_modules, attend) -> None:
    """Every module of ``attention_modules`` (a Hugging Face Llama's ``self_attn``) attends with
    ``attend(q, k, v, scale=)`` (ring or all-to-all over the context axis) through
    :data:`CONTEXT_ATTENTION`, which ``model.config`` selects. The registration is a fixed
    function under a fixed name (idempotent); what a module attends with is its own attribute.
    LayoutError, before any collective, for a config with a sliding window in effect or attention
    dropout."""
    _need_transformers()
    from transformers import AttentionInterface

    sliding = sliding_window_in_effect(model.config.to_dict())
    if sliding is not None:
        raise LayoutError(f"parallelize: a {type(model).__name__} with sliding_window={sliding} attends through a "
                          f"sliding window, and the context attention is plain causal. Fix: context=1, or "
                          f"sliding_window: null in the config.json.")
    dropout = getattr(model.config, "attention_dropout", 0.0)
    if dropout:
        raise LayoutError(f"parallelize: a {type(model).__name__} with attention_dropout={dropout}: the context "
                          f"attention has no dropout. Fix: context=1, or attention_dropout: 0.0 in the config.json.")
    AttentionInterface.register(CONTEXT_ATTENTION, _context_attention)
    model.config._attn_implementation = CONTEXT_ATTENTION
    for module in attention_modules:
        module.context_attention = attend


def position_ids(local_len: int, context: tuple, device) -> torch.Tensor:
    """[1, s] position ids of the tokens a Hugging Face model sees: 0 … s − 1, or under context
    parallelism (``context`` = (C, rank), C > 1) the global positions of the rank's two chunks
    (:func:`gridshard.context.sequence_split.global_positions`), from which its rotary embedding
    computes cos and sin."""
    from ..context.sequence_split import global_positions

    C, rank = context
    if C == 1:
        return torch.arange(local_len, device=device).unsqueeze(0)
    return global_positions(local_len, C, rank, device=device).unsqueeze(0)
