"""Checkpoints: sharded (each rank writes its blocks of the canonical tensors), asynchronous,
atomic, verified on load, and reshardable to any layout. See ``docs/checkpoints.md``."""
from ..errors import CheckpointError
from .checkpointer import Checkpointer
from .faults import FaultPlan, InjectedFault
from .files import checkpoints_root, read_latest, resolve_checkpoint, verify_checkpoint

__all__ = ["Checkpointer", "CheckpointError", "FaultPlan", "InjectedFault", "checkpoints_root", "read_latest",
           "resolve_checkpoint", "verify_checkpoint"]
