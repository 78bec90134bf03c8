"""Training engine: the composer (``build_job``, :mod:`.job`), one optimizer step
(``train_step``, :mod:`.step`), the trainer's loop over it (:mod:`.trainer`), AdamW (its
learning-rate schedule is :mod:`gridshard.schedule`), mixed precision, global-norm clipping,
metrics, stop requests and heartbeats. The data-parallel gradient reduction is
:mod:`gridshard.zero`'s reducer, for every ZeRO stage."""
from .job import Job, ResolvedConfig, build_job
from .step import StepBatch, StepResult, train_step
from .trainer import Trainer, train

__all__ = ["Job", "ResolvedConfig", "build_job", "StepBatch", "StepResult", "train_step", "Trainer", "train"]
