"""Hugging Face weights in and out: ``gridshard export`` and ``model.init_from``.

Export (one process, no process group): verify the checkpoint and read its ``model.*``
tensors whole through :mod:`gridshard.checkpoint.reader` (DCP assembles each canonical
tensor from whatever chunks the writing layout left), rename them to Hugging Face Llama names (``model.`` prefix except
``lm_head``; a model trained from ``model.hf_config`` already has them), and write one
``model.safetensors`` plus ``config.json`` — loadable by ``transformers``'
``LlamaForCausalLM.from_pretrained`` with no gridshard installed. A tied model writes no
``lm_head.weight`` and ``tie_word_embeddings: true``.

Import (``model.init_from``, every rank, any layout): each rank reads only its blocks
(:mod:`gridshard.checkpoint.blocks`) — from a Hugging Face folder with safetensors'
lazy slices (``safe_open(...).get_slice(name)[box]``), from a gridshard checkpoint through
the verifying reader (:meth:`gridshard.checkpoint.Checkpointer.load_weights`) — so no rank
ever holds a full tensor it does not own.
"""
from __future__ import annotations

import json
import os

import torch

from . import files as F
from ..errors import need_package
from .blocks import MODEL, model_blocks

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _need_safetensors():
    need_package("safetensors", "Hugging Face weights need the optional safetensors package. Fix: "
                 "pip install -e .[hf]", F.CheckpointError)


def hf_llama_config(model_cfg: dict) -> dict:
    """``config.json`` of a Hugging Face ``LlamaForCausalLM`` with gridshard's model fields
    (the resolved ``model`` section of a run's config); with experts, a ``MixtralForCausalLM``'s:
    the same decoder with every MLP an MoE block of softmax top-k routing with normalised weights
    (:func:`mixtral_shaped`: another MoE shape has no Hugging Face class of the same math)."""
    from ..models.hf import HF_CONFIG_KEYS

    m = {**model_cfg, "kv_heads": model_cfg.get("kv_heads") or model_cfg["heads"],
         "tie_embeddings": bool(model_cfg["tie_embeddings"])}
    fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              **{key: m[field] for field, (key, _) in HF_CONFIG_KEYS.items()}, "head_dim": m["hidden"] // m["heads"],
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
    if not m.get("experts"):
        return fields
    mixtral_shaped(m)
    return {**fields, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": m["expert_ffn_hidden"], "num_local_experts": m["experts"],
            "num_experts_per_tok": m["experts_per_token"], "router_jitter_noise": 0.0, "sliding_window": None}


def mixtral_shaped(m: dict) -> None:
    """CheckpointError unless the MoE model (resolved ``model`` fields) is what Hugging Face's
    ``MixtralForCausalLM`` computes: every layer MoE, softmax scores, normalised top-k weights, no
    shared experts."""
    wrong = [f"{k}={m.get(k)!r}" for k, want in (("moe_every", 1), ("router_score", "softmax"),
                                                 ("router_normalize", True), ("shared_experts", 0))
             if m.get(k) != want]
    if wrong:
        raise F.CheckpointError(f"this Mixture-of-Experts model ({', '.join(wrong)}) has no Hugging Face class "
                                f"that computes it: the export writes MixtralForCausalLM (moe_every=1, "
                                f"router_score=softmax, router_normalize=true, shared_experts=0). Fix: keep it in "
                                f"gridshard, or train a Mixtral-shaped model to export.")


def _without_zero_bias(tensors: dict) -> dict:
    """The checkpoint's tensors without the MoE routers' balancing bias, which Mixtral has no place
    for: dropped when zero (it never steered anything), a CheckpointError otherwise."""
    bias = {k: v for k, v in tensors.items() if k.endswith(".gate.expert_bias")}
    steered = [k for k, v in bias.items() if bool(v.any())]
    if steered:
        raise F.CheckpointError(f"{steered[0]} is not zero: this model was trained with train.moe_bias_rate, whose "
                                f"balancing bias steers the routing, and MixtralForCausalLM has no such bias. Fix: keep "
                                f"it in gridshard, or export a model trained with moe_bias_rate=0.")
    return {k: v for k, v in tensors.items() if k not in bias}


def _hf_config_json(path: str, model_cfg: dict) -> dict:
    """The Hugging Face ``config.json`` a ``model.hf_config`` run was trained from, parsed
    (never copied byte for byte: ``meta.json`` names the path, and a checkpoint from elsewhere
    could name any file) and checked to describe the checkpoint's model."""
    from ..models.hf import model_config_of_hf_json, read_hf_json

    fields = read_hf_json(path)
    dims = vars(model_config_of_hf_json(path)) if isinstance(fields, dict) else None
    keys = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "tie_embeddings")
    if dims is None or any(dims.get(k) != model_cfg.get(k) for k in keys):
        raise F.CheckpointError(f"model.hf_config={path!r} (named by the checkpoint's meta.json) does not describe the "
                                f"checkpoint's model. Fix: restore the config.json the run was trained from.")
    return fields


def export_hf(folder: str, out_dir: str) -> list:
    """Write ``out_dir/model.safetensors``, ``config.json`` and the run's tokenizer files
    (:mod:`gridshard.checkpoint.hf_tokenizer`) from checkpoint ``folder``, each mode 0644;
    returns the written paths. The checkpoint is verified first."""
    _need_safetensors()
    from safetensors.torch import save_file

    from ..models.hf import export_hf_state_dict

    from .reader import read_checkpoint

    checked, tensors = read_checkpoint(folder)      # verified: manifest, meta.json against the tensors, tensors only
    meta = checked.meta
    model_cfg = meta["config"]["model"]
    hf_json = model_cfg.get("hf_config")
    hf_fields = _hf_config_json(hf_json, model_cfg) if hf_json else None
    vit = model_cfg.get("kind") == "vit"
    if hf_json or vit:                              # HF's names already (a ViT's are ViTForImageClassification's)
        named = {k: v.contiguous() for k, v in _without_zero_bias(tensors).items()}
        if vit:
            from ..models.vit import hf_vit_config_fields, saved_model_config

            hf_fields = hf_vit_config_fields(saved_model_config(model_cfg))
    else:
        named, hf_fields = export_hf_state_dict(_without_zero_bias(tensors)), hf_llama_config(model_cfg)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_fields, f, indent=1)
    weights = os.path.join(out_dir, SAFETENSORS)
    save_file(named, weights, metadata={"format": "pt", "gridshard_step": str(meta["step"])})
    from .hf_tokenizer import export_tokenizer      # tokenizer.json & co. (or one line saying why not)

    paths = [weights, os.path.join(out_dir, "config.json")]
    if not vit:                                     # a ViT reads images: no tokenizer
        paths += export_tokenizer(meta["config"], folder, out_dir)
    for path in paths:                              # readable by the group whatever the umask
        os.chmod(path, 0o644)
    return paths


def _safetensors_files(folder: str) -> dict:
    """HF tensor name → file, from the index (sharded) or the single file."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    single = os.path.join(folder, SAFETENSORS)
    if not os.path.isfile(single):
        raise F.CheckpointError(f"model.init_from={folder!r} holds neither {SAFETENSORS} nor {SAFETENSORS_INDEX} nor "
                                f"a gridshard checkpoint (meta.json). Fix: point it at a Hugging Face model folder "
                                f"or a RUN_DIR/checkpoints/step_N folder.")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def load_hf_blocks(model: torch.nn.Module, folder: str, hf_names: bool) -> None:
    """Fill this rank's blocks of ``model`` from a Hugging Face folder (lazy slices)."""
    _need_safetensors()
    from safetensors import safe_open

    from ..models.hf import gridshard_to_hf_name

    where = _safetensors_files(folder)
    boxes = model_blocks(model)
    handles = {}
    try:
        for fqn, b in boxes.items():
            name = fqn[len(MODEL):]
            key = name if hf_names else gridshard_to_hf_name(name)
            if key not in where:
                raise F.CheckpointError(f"model.init_from={folder!r} has no tensor {key!r} (model parameter "
                                        f"{name!r}). Fix: export from a model with the same architecture.")
            path = where[key]
            if path not in handles:
                handles[path] = safe_open(path, framework="pt")
            sl = handles[path].get_slice(key)
            shape = tuple(sl.get_shape())
            if shape != tuple(b.global_size):
                raise F.CheckpointError(f"model.init_from: {key!r} has shape {shape}, the model expects "
                                        f"{tuple(b.global_size)}. Fix: use weights of the same model config.")
            box = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))
            with torch.no_grad():
                b.view.copy_(sl[box] if box else sl[:])
    finally:
        handles.clear()


def is_gridshard_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, F.META))
