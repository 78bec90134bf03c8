"""Test helpers, and the code only tests (and benchmarks) use: a pool of reusable gloo worker
groups (:mod:`.multiprocess`) and training runs on them, cached per config (:mod:`.train_cache`),
reference comparisons (:mod:`.compare`, :mod:`.parallel_reference`), the single-device
reference layers under the initialisation contract (:mod:`.plain`), DTensor views of a laid-out
model (:mod:`.dtensor_views`) and the by-name Hugging Face weight import into a plain model
(:mod:`.hf_weights`), and the peak of the tensor bytes a region keeps alive (:mod:`.live_bytes`,
for benchmarks)."""
from .multiprocess import RankFailure, WorkerGroup, run_on_ranks, shutdown_all
from .compare import assert_close

__all__ = ["RankFailure", "WorkerGroup", "run_on_ranks", "shutdown_all", "assert_close"]
