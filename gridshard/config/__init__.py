"""Training configs: typed schema, YAML/dict loading with overrides, validation against the world size.

``resolve_config(source, overrides, world_size)`` is the one call the CLI and the
trainer make: load, type-check, then apply every cross-field rule, raising a single
:class:`gridshard.errors.ConfigError` before any process group exists.
"""
from typing import Iterable, Optional

from .load import apply_overrides, default_config_dict, from_dict, load_config, parse_yaml, read_yaml
from .schema import DataSection, ModelSection, ParallelSection, TrainConfig, TrainSection
from .validate import validate_config


def resolve_config(source=None, overrides: Iterable[str] = (), world_size: Optional[int] = None,
                   cuda_available: Optional[bool] = None) -> TrainConfig:
    """Load ``source`` (YAML path, dict, TrainConfig or None = default), apply ``overrides``
    and validate against ``world_size`` (default: the config's own D·P·T)."""
    import torch

    cfg = load_config(source, overrides)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return validate_config(cfg, cfg.world_size if world_size is None else world_size, cuda_available)


__all__ = ["TrainConfig", "ParallelSection", "ModelSection", "DataSection", "TrainSection", "load_config",
           "from_dict", "apply_overrides", "default_config_dict", "parse_yaml", "read_yaml", "validate_config",
           "resolve_config"]
