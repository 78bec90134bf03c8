"""The job layout (gridshard.job_layout): every derived layout fact decided once, from the config.

Pure functions, no process group: the tensor mode round-trips its config string, sequence
parallelism is in effect only in 1d with T > 1, micro-batches per step, the stage split equals
what the pipeline builds, and kv replication."""
from __future__ import annotations

import json

import pytest
import torch

from gridshard.config import load_config
from gridshard.errors import LayoutError
from gridshard.job_layout import JobLayout, StageSplit, TensorMode, micro_batches_per_step
from gridshard.models import ModelConfig, Transformer
from gridshard.pipeline.split import RankModel


def _job(**over) -> JobLayout:
    parallel = {"data": 1, "tensor": 1, "tensor_mode": "none", "pipeline": 1, **over.pop("parallel", {})}
    overrides = [f"parallel.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in parallel.items()]
    overrides += [f"{k}={v}" for k, v in over.items()]
    return JobLayout.from_config(load_config("configs/tiny.yaml", overrides))


@pytest.mark.parametrize("name", ["none", "1d", "2d"])
def test_tensor_mode_round_trips_the_config_string(name):
    mode = TensorMode.parse(name)
    assert mode is TensorMode(name) and TensorMode.parse(mode) is mode
    assert mode == name and str(mode) == name and f"{mode}" == name and repr(mode) == repr(name)
    assert json.dumps({"tensor_mode": mode}) == json.dumps({"tensor_mode": name})
    assert mode.splits_weights == (name != "none") and (mode.side(4) == 2) == (name == "2d")
    assert mode.sequence_parallel_in_effect(True, 2) == (name == "1d")


def test_unknown_mode_and_bad_sizes_are_named():
    with pytest.raises(LayoutError, match=r"tensor_mode='4d' is unknown.*Fix"):
        TensorMode.parse("4d")
    with pytest.raises(LayoutError, match=r"tensor=8 is not a perfect square.*tensor=4 or tensor=9"):
        TensorMode.TWO_D.check_tensor_size(8)
    with pytest.raises(LayoutError, match=r"tensor_mode='none' with tensor=2"):
        TensorMode.NONE.check_tensor_size(2)
    TensorMode.ONE_D.check_tensor_size(3)
    assert TensorMode.TWO_D.side(9) == 3 and TensorMode.ONE_D.side(4) is None


def test_sequence_parallel_in_effect_only_in_1d_with_more_than_one_rank():
    assert TensorMode.ONE_D.sequence_parallel_in_effect(True, 2)
    assert not TensorMode.ONE_D.sequence_parallel_in_effect(True, 1)        # requested, but nothing to split
    assert not TensorMode.ONE_D.sequence_parallel_in_effect(False, 4)
    assert not TensorMode.TWO_D.sequence_parallel_in_effect(True, 4)
    assert not TensorMode.NONE.sequence_parallel_in_effect(True, 1)


def test_job_layout_of_a_config():
    job = _job(parallel={"data": 2, "tensor": 2, "tensor_mode": "1d", "sequence_parallel": True},
               **{"train.global_batch": 16, "train.micro_batch": 2, "train.zero": 2, "train.recompute": "full"})
    assert (job.world, job.data, job.pipeline, job.tensor, job.q) == (4, 2, 1, 2, None)
    assert job.mode is TensorMode.ONE_D and job.sequence_parallel
    assert job.micro_batches == 16 // (2 * 2) == micro_batches_per_step(16, 2, 2)
    assert (job.zero, job.recompute, job.virtual_stages, job.split.counts) == (2, "full", 1, (2,))
    grid = _job(parallel={"tensor": 4, "tensor_mode": "2d"})
    assert grid.q == 2 and not grid.sequence_parallel and grid.mode.batch_split(4) == 2


def test_stage_split_equals_what_the_pipeline_builds():
    job = _job(parallel={"pipeline": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b"},
               **{"model.layers": 6, "train.global_batch": 16, "train.micro_batch": 4})
    split = job.split
    assert (split.stages, split.virtual_stages) == (4, 2) and split.counts == (1, 2, 2, 1)
    assert split.layer_ids() == [[0], [1, 2], [3, 4], [5]]
    assert [split.rank_layer_ids(r) for r in range(2)] == [[0, 3, 4], [1, 2, 5]]
    assert (split.holds_first(0), split.holds_last(0), split.holds_first(1), split.holds_last(1)) == \
        (True, False, False, True)
    with torch.device("meta"):
        plain = Transformer(ModelConfig(vocab_size=32, hidden=16, layers=6, heads=2, ffn_hidden=32))
    for r in range(2):
        built = RankModel(plain, split.rank_layer_ids(r), split.holds_first(r), split.holds_last(r))
        assert [int(i) for i in built.layers.keys()] == split.rank_layer_ids(r)
    assert StageSplit.of(5, 2, explicit=[1, 4]).counts == (1, 4)


@pytest.mark.parametrize("mode,T,K,local,shared", [("1d", 4, 2, 1, 2), ("1d", 2, 4, 2, 1), ("1d", 4, 4, 1, 1),
                                                   ("2d", 4, 4, 2, 1), ("none", 1, 3, 3, 1)])
def test_kv_heads_split_or_replicated(mode, T, K, local, shared):
    m = TensorMode.parse(mode)
    assert (m.local_kv_heads(K, T), m.kv_replication(K, T)) == (local, shared)


def test_boundary_block_per_mode():
    assert TensorMode.NONE.boundary_block(1, False, 4, 8, 16) == (4, 8, 16)
    assert TensorMode.ONE_D.boundary_block(2, False, 4, 8, 16) == (4, 8, 16)
    assert TensorMode.ONE_D.boundary_block(2, True, 4, 8, 16) == (4, 4, 16)
    assert TensorMode.TWO_D.boundary_block(4, False, 4, 8, 16) == (2, 8, 8)


def test_three_d_mode_facts():
    """3D (T = q³): cube side, head split q, batch split q², K/q kv heads, the [m/q², s, h/q] boundary block,
    and the size check naming the valid cubes."""
    mode = TensorMode.parse("3d")
    assert mode.where(8) == "on a q=2 cube" and mode.splits_weights and str(mode) == "3d"
    assert (mode.side(8), mode.side(27), mode.head_split(27), mode.batch_split(27)) == (2, 3, 3, 9)
    assert (mode.local_kv_heads(6, 27), mode.kv_replication(2, 8)) == (2, 1)
    assert not mode.sequence_parallel_in_effect(True, 8)
    assert mode.boundary_block(27, False, 18, 16, 36) == (2, 16, 12)
    mode.check_tensor_size(64)
    for bad in (1, 4, 9, 16):
        with pytest.raises(LayoutError, match=r"T must be q³ with q >= 2 \(valid: 8, 27, 64, 125, \.\.\.\)"):
            mode.check_tensor_size(bad)
