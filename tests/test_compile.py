"""``train.compile``: each decoder layer's forward under ``torch.compile`` gives the eager
run's losses (relative 1e-5) and parameters, on one device and with 1D tensor parallelism
(whose collectives are graph breaks that run eagerly: the ledger's calls are unchanged)."""
import pytest
import torch
import torch.distributed as dist

from gridshard.engine import Trainer
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 4, "lr": 3e-3, "warmup_steps": 1, "log_interval": 1,
                  "seed": 3, "eval_interval": 0}}


def _cfg(T, mode, sp, compile_):
    return {**BASE, "parallel": {"data": 1, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp},
            "train": {**BASE["train"], "compile": compile_}}


def _body(cfg):
    torch._dynamo.reset()
    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    calls = {k: v.count for k, v in trainer.ledger.entries.items() if k[1] != "world"}
    state = gathered_state_dict(trainer.model)
    return (losses, state, calls) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("layout", [(1, "none", False), (2, "1d", True)], ids=["T1", "T2-1d-SP"])
def test_compiled_layers_train_like_eager(layout):
    T, mode, sp = layout
    eager, compiled = (run_on_ranks(T, _body, _cfg(T, mode, sp, c), timeout=600)[0] for c in (False, True))
    for a, b in zip(eager[0], compiled[0]):
        assert abs(a - b) <= 1e-5 * abs(a), (eager[0], compiled[0])
    assert len(eager[0]) == len(compiled[0]) == BASE["train"]["steps"]
    # parameters as a whole (AdamW turns rounding-level gradient differences of near-zero
    # gradient elements into differences of a few lr·1e-3 in single elements)
    for k, v in eager[1].items():
        rel = float((compiled[1][k] - v).norm() / v.norm())
        assert rel <= 1e-4, (k, rel)                  # as the layout-equivalence tests
    assert compiled[2] == eager[2]                 # the same collectives, in number, as eager
