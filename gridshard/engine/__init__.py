"""Training engine: the loop, data-parallel gradient averaging, AdamW + schedule,
mixed precision, global-norm clipping and metrics."""
from .trainer import Trainer, train

__all__ = ["Trainer", "train"]
