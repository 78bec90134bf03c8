"""Emulated ranks (``gridshard emulate``, :mod:`gridshard.planner.emulate`): each rank of a D2 T2
(1D + SP, ZeRO-1) job, built alone in a process of its own on torch's fake process group, holds the
same model-state bytes and records the same ledger bytes per axis as that rank of the real gloo
run, and so does each rank of a P2 D2 pipeline (and ranks 0, 1, 9 and 15 of the issue's three 16-rank
layouts in the wide matrix); bad ``--ranks`` and expert parallelism (not emulated yet) are refused before any process starts."""
import os

import pytest
from click.testing import CliRunner

from gridshard.cli import main
from gridshard.config import load_config
from gridshard.errors import ConfigError
from gridshard.planner.emulate import chosen_ranks, emulate
from gridshard.testing import run_on_ranks

CFG = {"model": {"preset": "tiny", "layers": 2}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 50_000},
       "parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d", "sequence_parallel": True},
       "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "log_interval": 1, "eval_interval": 0, "zero": 1}}
STEPS = 2


def _real_rank(cfg, steps):
    """The real rank: the same steps as emulation (train_step on the job's own batches)."""
    from gridshard.engine import Trainer
    from gridshard.engine.memory_meter import model_state_tensor_bytes
    from gridshard.engine.step import train_step

    job = Trainer(cfg, progress=False).job
    for k in range(steps):
        train_step(job, job.batch(k))
    state = model_state_tensor_bytes(job.model, job.optimizer, job.reducer.memory_tensors())
    return {a: b / steps for a, b in sorted(job.ledger.by_axis().items()) if b}, sum(state.values())


def _compare(cfg: dict, world: int, ranks=None):
    """Each of ``ranks`` (default: every rank) emulated against that rank of the real run."""
    ranks = list(range(world)) if ranks is None else ranks
    real = run_on_ranks(world, _real_rank, cfg, STEPS, timeout=900)
    reports = emulate(load_config(cfg), world, ranks, steps=STEPS)
    for rank, report in zip(ranks, reports):
        comm, state = real[rank]
        assert report["rank"] == rank
        assert report["comm_bytes"] == comm, (rank, report["comm_bytes"], comm)
        assert report["model_state_bytes"] == state == report["predicted_model_state_bytes"], (rank, report, state)
        assert 0.8 < report["peak_bytes"] / report["predicted_peak_bytes"] < 1.25, report
        assert report["compute_s"] > 0 and report["predicted_compute_s"] > 0
    return reports


def test_emulated_ranks_hold_and_move_what_the_real_ranks_do():
    reports = _compare(CFG, 4)
    assert [r["coords"] for r in reports] == [{"data": r // 2, "pipeline": 0, "context": 0, "tensor": r % 2}
                                              for r in range(4)]
    assert set(reports[0]["comm_bytes"]) == {"data", "tensor"}
    assert {"gridshard.forward", "gridshard.backward", "gridshard.optimizer"} <= set(reports[0]["phases_s"])


@pytest.mark.wide
def test_emulated_pipeline_ranks():
    """P2 D2 (1F1B): the stages' start-up vote is answered locally; the sends are in the ledger."""
    reports = _compare({**CFG, "parallel": {"data": 2, "pipeline": 2}, "train": {**CFG["train"], "global_batch": 16}}, 4)
    assert reports[0]["comm_bytes"]["pipeline"] > 0


@pytest.mark.wide
@pytest.mark.parametrize("parallel,train", [
    ({"data": 4, "pipeline": 2, "tensor": 2, "tensor_mode": "1d", "sequence_parallel": True}, {"zero": 1}),
    ({"data": 2, "tensor": 8, "tensor_mode": "3d"}, {"zero": 3, "micro_batch": 4}),
    ({"pipeline": 4, "tensor": 4, "tensor_mode": "2d", "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
     {"global_batch": 16}),
], ids=["D4P2T2-1d-sp-z1", "D2T8-3d-z3", "P4T4-2d-interleaved"])
def test_the_issue_layouts_on_sixteen_ranks(parallel, train):
    """Ranks 0 and 15 (the first and last pipeline stage where P > 1), 1 (rank 0's tensor peer) and 9
    (another data or stage position) of each, emulated alone (one process each) against the real run."""
    cfg = {**CFG, "model": {"preset": "tiny", "layers": 8}, "parallel": parallel,
           "train": {**CFG["train"], "global_batch": 32, **train}}
    _compare(cfg, 16, [0, 1, 9, 15])


def test_ranks_and_refusals():
    assert chosen_ranks("first,last", 8) == [0, 7] and chosen_ranks("all", 3) == [0, 1, 2]
    assert chosen_ranks("5, 1,first", 8) == [0, 1, 5]
    with pytest.raises(ConfigError, match="'8' is not a rank of the 8-rank job"):
        chosen_ranks("0,8", 8)
    moe = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_moe.yaml"), ["parallel.expert=2"])
    with pytest.raises(ConfigError, match="parallel.expert=2: with expert parallelism an MoE layer's dispatch sizes"):
        emulate(moe, moe.world_size, [0])
    out = CliRunner().invoke(main, ["emulate", "--gpus", "4", "--ranks", "9", "parallel.data=2", "parallel.tensor=2",
                                    "parallel.tensor_mode=1d"])
    assert out.exit_code == 2 and "gridshard emulate: --ranks '9'" in out.output, out.output


@pytest.mark.wide
def test_plan_emulate_reranks_with_measured_compute():
    """``gridshard plan --emulate 2``: the top two layouts, each re-priced with its emulated ranks."""
    from gridshard.planner import plan
    from gridshard.planner.emulate import emulated_plan

    result = plan({**CFG, "parallel": {"data": 4}}, 4)
    rows = emulated_plan(result, 2, steps=2)
    assert sorted(r["layout"] for r in rows) == sorted(c.layout.label() for c in result.candidates[:2])
    assert [r["emulated_step_s"] for r in rows] == sorted(r["emulated_step_s"] for r in rows)
    for r in rows:
        assert r["measured_compute_s"] > 0 and r["emulated_step_s"] > 0 and not r["dropped"]
        assert {x["rank"] for x in r["ranks"]} == {0, 3}


FREED_HEAP = """
import sys, torch
from gridshard.engine.memory_meter import unmap_large_frees
if sys.argv[1] == "unmap":
    assert unmap_large_frees()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
x = torch.ones(1 << 20)             # a 4 MiB block freed: glibc raises its mmap threshold to 4 MiB
del x
base = rss()
blocks = [torch.ones(1 << 19) for _ in range(64)]      # 64 blocks of 2 MiB
last = blocks[-1]
del blocks                          # all freed but the last
print(rss() - base)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
def test_unmapped_frees_leave_the_resident_set():
    """An emulated CPU rank's peak resident set is its live bytes (``unmap_large_frees``): after 63 of
    64 freed 2 MiB tensors, glibc's heap keeps ~126 MiB resident by default and gives it back with it."""
    import subprocess
    import sys

    kept = {how: int(subprocess.run([sys.executable, "-c", FREED_HEAP, how], check=True, capture_output=True,
                                    text=True).stdout) for how in ("default", "unmap")}
    assert kept["default"] > 64 * 2**20 and kept["unmap"] < 16 * 2**20, kept
