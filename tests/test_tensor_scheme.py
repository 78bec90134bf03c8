"""A tensor mode is a registered scheme (gridshard/tensor_scheme.py, docs/architecture.md):

* shared code asks the scheme and never branches on a mode: outside ``gridshard/tensor/``, the
  registry and the config schema no code compares a mode's name or tests a per-mode predicate;
* a mode defined entirely here, with no edit to the package, registers, passes the config rules,
  trains our Llama at T = 2 with the per-step losses of one process, and is priced by the memory
  model and the planner. The mode keeps every weight whole on each of its T ranks and splits only
  the batch: rank t of the tensor group reads batch block t, and the tensor dim joins the gradient
  reduction (``weight_replica_dims``), so it is data parallelism spelled as a tensor mode — the
  smallest scheme that exercises the mesh, token sharding, loss, reduction, memory and planner hooks.
"""
import os
import re

import pytest

from gridshard.tensor.base import Scheme
from gridshard.tensor_scheme import DivisibilityRule, register_tensor_scheme, tensor_schemes, unregister_tensor_scheme
from gridshard.theory.memory import INDEX_BYTES, RankShape
from gridshard.testing.compare import max_rel
from gridshard.testing.train_cache import TrainCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gridshard")
ALLOWED = ("tensor" + os.sep, "tensor_scheme.py", os.path.join("config", "schema.py"))
# mode predicates and mode-name comparisons that the schemes replaced (docs/architecture.md, "The check")
BRANCH = re.compile(r"\.(is_1d|is_grid|is_cube|has_depth|splits_weights)\b|\.(grid_side|cube_side)\("
                    r"|TensorMode\.(NONE|ONE_D|TWO_D|TWO_P5_D|THREE_D)\b|tensor_scheme\([\"']"
                    r"""|mode\)?\s*(==|!=|\bin)\s*\(?\s*["'](none|1d|2d|2\.5d|3d)["']""")


def test_no_mode_branch_outside_the_schemes():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, PACKAGE)
            if not f.endswith(".py") or rel.startswith(ALLOWED):
                continue
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                if BRANCH.search(line.split("#")[0]):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "per-mode branches outside gridshard/tensor/:\n" + "\n".join(found)
    assert all(BRANCH.search(line) for line in ('if mode.is_grid:', 'x = layout.tensor_mode == "2d"',
                                               'TensorMode.ONE_D.head_split(T)', 'tensor_scheme("3d")'))


class ReplicasScheme(Scheme):
    """Weights whole on each of the T ranks; rank t takes batch block t of the micro-batch."""

    key, constant, summary = "replicas", "REPLICAS", "weights replicated, batch split (a test mode)"

    def check_tensor_size(self, T, depth=1):
        self.check_no_depth(depth)

    def batch_split(self, T):
        return T

    def weight_replica_dims(self):
        return ("tensor",)

    def check_unplanned(self, name, module):
        pass                                            # nothing is split: a module may stay unplanned

    def batch_rules(self, T, sequence_parallel, batch, seq):
        return [DivisibilityRule("micro_batch", batch, T, "tensor", "the test mode splits the micro-batch")]

    def attach_axes(self, mesh, device_mesh, submesh, ledger):
        self.attach_shape_axes(mesh, mesh.tensor.rank)
        return []

    def attach_shape_axes(self, mesh, tensor_rank):
        mesh.batch_blocks, mesh.batch_index = mesh.tensor.size, tensor_rank

    def rank_shape(self, cfg, T, sequence_parallel, tokens):
        rows = tokens // T
        return RankShape(rows, rows * cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab_size)

    def embedding_saved_bytes(self, T, tokens):
        return tokens * INDEX_BYTES


REPLICAS = ReplicasScheme()
CFG = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
       "train": {"global_batch": 4, "micro_batch": 4, "steps": 8, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5,
                 "log_interval": 1, "seed": 7, "precision": "fp32"}}


@pytest.fixture
def replicas():
    register_tensor_scheme(REPLICAS)
    yield REPLICAS
    unregister_tensor_scheme("replicas")


def _train(cfg):
    from gridshard.engine import Trainer

    register_tensor_scheme(REPLICAS)                    # in the worker process too
    try:
        trainer = Trainer(cfg, progress=False)
        predicted = trainer.predicted_mem.total if trainer.predicted_mem is not None else None
        return trainer.run(), [h["grad_norm"] for h in trainer.history], predicted
    finally:
        unregister_tensor_scheme("replicas")


_RUNS = TrainCache(_train, agree=2, timeout=300)


def test_a_mode_defined_in_the_tests_trains_like_one_process(replicas):
    one, norms_one, _ = _RUNS({**CFG, "parallel": {"tensor_mode": "none"}})
    two, norms, predicted = _RUNS({**CFG, "parallel": {"tensor": 2, "tensor_mode": "replicas"}})
    assert len(one) == len(two) == 8 and one[-1] < one[0]
    assert max_rel(two, one) < 1e-4 and max_rel(norms, norms_one) < 1e-4, (two, one)
    assert predicted is not None and predicted > 0       # the trainer's memory prediction priced the mode


def test_the_memory_model_and_the_planner_price_it(replicas):
    from gridshard import plan
    from gridshard.config import load_config
    from gridshard.planner.cost_memory import layout_memory
    from gridshard.planner.fit import config_layout

    def predicted(parallel):
        cfg = load_config({**CFG, "parallel": parallel})
        return layout_memory(cfg.model.resolve(), config_layout(cfg), cfg.data.seq_len, cfg.train.global_batch,
                             0, 0.0, cfg.train.precision)[0]

    assert replicas in tensor_schemes()
    two, one = predicted({"tensor": 2, "tensor_mode": "replicas"}), predicted({"tensor_mode": "none"})
    assert 0 < two.activations < one.activations           # half the rows per rank
    assert two.params == one.params                         # every weight whole
    result = plan(load_config(CFG), gpus=2, hardware="cpu")
    assert any(c.layout.tensor_mode == "replicas" for c in result.candidates), \
        [c.layout.label() for c in result.candidates]
