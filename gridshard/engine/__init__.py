"""Training engine: the trainer (the job's composition and its step), AdamW + schedule,
mixed precision, global-norm clipping, metrics, stop requests and heartbeats. The
data-parallel gradient reduction is :mod:`gridshard.zero`'s reducer, for every ZeRO stage."""
from .trainer import Trainer, train

__all__ = ["Trainer", "train"]
