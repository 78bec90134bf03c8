"""gridshard: data, 1D/2D tensor and pipeline parallelism for transformer training on PyTorch."""
from . import _stop

_stop.install_early()        # a launched worker: Ctrl-C while importing is a stop request (gridshard/_stop.py)
from .errors import GridshardError, LayoutError, ShapeError, ConfigError, CheckpointError, NonFiniteError, SaveError
from . import tensor  # noqa: F401  (registers the built-in tensor schemes: gridshard/tensor/)
from .job_layout import JobLayout, TensorMode
from .tensor_scheme import TensorScheme, register_tensor_scheme
from .mesh import ParallelMesh, Axis, build_mesh, init_distributed, validate_layout
from .comm.ledger import LEDGER
from .parallel import gathered_state_dict, parallelize
from .planner import plan
from .engine.job import build_job
from .engine.step import train_step

__version__ = "0.1.0"
__all__ = ["GridshardError", "LayoutError", "ShapeError", "ConfigError", "CheckpointError", "NonFiniteError", "SaveError",
           "JobLayout", "TensorMode", "TensorScheme", "register_tensor_scheme", "ParallelMesh", "Axis", "build_mesh", "init_distributed", "validate_layout",
           "LEDGER", "parallelize", "gathered_state_dict", "plan", "build_job", "train_step"]
