"""Read a config from YAML or a dict, apply ``key.sub=value`` overrides, type-check it.

Every failure is one :class:`gridshard.errors.ConfigError` whose message names the
field, the bad value, the rule and a fix. YAML is read with one change to PyYAML's
safe loader: ``3e-4`` is a float (YAML 1.1 would read it as a string).
"""
from __future__ import annotations

import copy
import difflib
import os
import re
from typing import Iterable, Optional, Union

import yaml
from pydantic import ValidationError

from ..errors import ConfigError, LayoutError
from ..models.presets import preset_names
from ..tensor_scheme import tensor_scheme
from .schema import TrainConfig


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (``3e-4``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, where: str = "config"):
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}. Fix: check indentation and `key: value` syntax.") from None


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        hint = f" (an override needs a value: {path}=VALUE)" if "." in path and not path.endswith(
            (".yaml", ".yml")) else ""
        raise ConfigError(f"config file {path!r} does not exist{hint}. Fix: give the path of a YAML file "
                          f"(e.g. configs/tiny.yaml) or no CONFIG for the built-in default.")
    with open(path) as f:
        raw = parse_yaml(f.read(), path)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} holds a {type(raw).__name__}, not a mapping. "
                          f"Fix: write sections `parallel:`, `model:`, `data:`, `train:` at the top level.")
    return raw


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """A copy of ``raw`` with each ``a.b=value`` set (value parsed as YAML)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value. "
                              f"Fix: write e.g. train.lr=1e-3 or parallel.tensor_mode=1d.")
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is a value, not a section. "
                                  f"Fix: override the whole key or a field of a section.")
            node = child
        node[parts[-1]] = parse_yaml(text, f"value of override {key}") if text != "" else None
    return out


_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "model_type": "a mapping of fields", "dict_type": "a mapping of fields",
               "int_from_float": "an integer", "int_parsing": "an integer", "float_parsing": "a number"}


def _error_message(err: dict) -> str:
    loc = tuple(str(x) for x in err["loc"])
    field = ".".join(loc)
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        # an unknown key is a section's (section, key) or a top-level one (key,): sections hold no models
        allowed = list((TrainConfig.model_fields[loc[0]].annotation if len(loc) > 1 else TrainConfig).model_fields)
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean {'.'.join(loc[:-1] + (close[0],))}?" if close else f"known fields here: {allowed}"
        return f"unknown field {field} (value {value!r}): configs accept only known keys. Fix: {hint}"
    if kind == "literal_error":
        return (f"{field}={value!r} is not allowed: it must be {err['ctx']['expected']}. "
                f"Fix: set {field} to one of those.")
    if kind in _TYPE_WORDS:
        want = _TYPE_WORDS[kind]
        return (f"{field}={value!r} has the wrong type ({type(value).__name__}): it must be {want}. "
                f"Fix: write {field} as {want} (no quotes around numbers or booleans).")
    return f"{field}={value!r} is invalid: {err['msg']}. Fix: correct {field}."


def from_dict(raw: Optional[dict]) -> TrainConfig:
    """Type-check a plain dict into a :class:`TrainConfig` (no world-size rules yet)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}. "
                          f"Fix: pass a dict like {{'train': {{'steps': 10}}}}.")
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        more = f" ({len(errors) - 1} more problem(s) after this one)" if len(errors) > 1 else ""
        raise ConfigError(_error_message(errors[0]) + more) from None
    try:
        tensor_scheme(cfg.parallel.tensor_mode)           # a registered scheme (gridshard/tensor_scheme.py)
    except LayoutError as e:
        raise ConfigError(f"parallel.tensor_mode={cfg.parallel.tensor_mode!r} is not allowed: {e}") from None
    if cfg.model.preset is not None and cfg.model.preset not in preset_names():
        close = difflib.get_close_matches(cfg.model.preset, preset_names(), n=1)
        raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown: presets are {preset_names()}. "
                          f"Fix: use {close[0] if close else 'tiny'!r}, or preset: null with explicit fields.")
    if cfg.model.kind == "vit":
        return _vit_defaults(cfg)
    if cfg.model.preset is None:
        missing = [k for k in ("vocab_size", "hidden", "layers", "heads", "ffn_hidden")
                   if getattr(cfg.model, k) is None]
        if missing:
            raise ConfigError(f"model.preset is null and model.{missing[0]} is not set: without a preset the "
                              f"fields {missing} are required. Fix: set them or choose a preset.")
    return cfg


def _vit_defaults(cfg: TrainConfig) -> TrainConfig:
    """``model.kind: vit``: the presets are the decoder's (a preset the user wrote is an error, the
    default one is dropped), and ``data.seq_len`` is the ViT's 1 + patches (set when not written,
    an error when written otherwise)."""
    if "preset" in cfg.model.model_fields_set and cfg.model.preset is not None:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is invalid with model.kind=vit: the presets are "
                          f"decoder (llama) sizes. Fix: remove model.preset (or set it to null) and give the ViT's "
                          f"fields (image_size, patch_size, channels, num_classes, hidden, layers, heads, ffn_hidden).")
    cfg.model.preset = None
    tokens = cfg.model.resolve().seq_len
    if "seq_len" in cfg.data.model_fields_set and cfg.data.seq_len != tokens:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is invalid with model.kind=vit: a ViT reads 1 + "
                          f"(image_size/patch_size)² = {tokens} tokens per image. Fix: remove data.seq_len.")
    cfg.data.seq_len = tokens
    return cfg


def load_config(source: Union[None, str, dict, TrainConfig] = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Config from a YAML path, a dict, or ``None`` (the built-in default), plus overrides."""
    if isinstance(source, TrainConfig):
        raw = source.model_dump()
    elif isinstance(source, str):
        raw = read_yaml(source)
    else:
        raw = source if source is not None else default_config_dict()
    return apply_prepared(from_dict(apply_overrides(raw, list(overrides))))


def apply_prepared(cfg: TrainConfig) -> TrainConfig:
    """``data.kind: prepared``: ``model.vocab_size`` and ``data.token_dtype`` come from the
    folder's ``meta.json`` (an explicit, different ``model.vocab_size`` is an error)."""
    if cfg.data.kind != "prepared" or not cfg.data.path:
        return cfg
    from ..data.prepare import read_meta

    meta = read_meta(cfg.data.path)
    vocab = meta["vocab_size"]
    if cfg.model.hf_config is None:
        if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: data.path={cfg.data.path!r} was "
                              f"prepared with a tokenizer of {vocab} ids and sets the vocabulary. Fix: remove "
                              f"model.vocab_size (or set it to {vocab}).")
        cfg.model.vocab_size = vocab
    cfg.data.token_dtype = meta["token_dtype"]
    if cfg.data.val_path is not None:
        other = read_meta(cfg.data.val_path)
        if other["tokenizer"] != meta["tokenizer"] or other["vocab_size"] != vocab:
            raise ConfigError(f"data.val_path={cfg.data.val_path!r} was prepared with another tokenizer than "
                              f"data.path={cfg.data.path!r}. Fix: prepare it with --tokenizer "
                              f"{os.path.join(cfg.data.path, 'tokenizer.json')}.")
    return cfg


def default_config_dict() -> dict:
    """What ``gridshard train`` runs with no CONFIG: the tiny model on Python's own source
    code, 2 data × 2 tensor (1d) ranks, ~1 minute on 4 CPU workers."""
    return {
        "parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d", "sequence_parallel": False, "pipeline": 1},
        "model": {},                       # the schema's default: preset tiny (llama); none for a vit
        "data": {},                        # the schema's default: stdlib bytes, seq_len 128 (a vit: its own)
        "train": {"global_batch": 16, "micro_batch": 4, "steps": 120, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 10, "precision": "fp32", "seed": 0, "log_interval": 10},
    }
