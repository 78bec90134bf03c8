"""Profiler traces on request (``train.profile_start`` / ``profile_steps`` / ``profile_ranks``,
:mod:`gridshard.engine.profiling`): a 4-rank run (D2 T2, 1D) writes one Chrome trace per rank that
parses as JSON and holds gridshard's named ranges — forward, backward, the gradient reduction, the
optimizer and each collective kind the step issues, on its axis — and nothing is recorded outside
the profiled steps; ``profile_ranks`` limits the ranks; bad values are refused before launch."""
import json

import pytest
import torch

from gridshard.config import load_config, validate_config
from gridshard.errors import ConfigError
from gridshard.testing import run_on_ranks

CFG = {"model": {"preset": "tiny", "layers": 2}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
       "parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d"},
       "train": {"global_batch": 4, "micro_batch": 1, "steps": 3, "log_interval": 3, "eval_interval": 0,
                 "profile_start": 2, "profile_steps": 1}}


def _train(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.run()
    return trainer.ranges.on


def _names(path) -> list:
    with open(path) as f:
        trace = json.load(f)
    return [e.get("name", "") for e in trace["traceEvents"]]


def test_four_ranks_write_traces_with_gridshard_ranges(tmp_path):
    left_on = run_on_ranks(4, _train, CFG, str(tmp_path), timeout=300)
    assert left_on == [False] * 4                      # recording stopped after the profiled step
    for rank in range(4):
        names = _names(tmp_path / "profile" / f"rank{rank}.trace.json")
        # one profiled step of 2 micro-batches per data rank (4 = 2 data ranks × 2 × micro-batch 1)
        assert names.count("gridshard.forward") == 2 and names.count("gridshard.backward") == 2, rank
        assert names.count("gridshard.optimizer") == 1 and names.count("gridshard.grad_reduce") == 1, rank
        collectives = {n.split()[0] + " " + n.split()[1] for n in names if n.startswith("gridshard.all_")}
        assert {"gridshard.all_reduce tensor", "gridshard.all_reduce data"} <= collectives, (rank, collectives)
        sized = [n for n in names if n.startswith("gridshard.all_reduce tensor ")]
        assert sized and all(n.endswith(" B") and int(n.split()[2]) > 0 for n in sized)


def test_profile_ranks_limits_who_records(tmp_path):
    cfg = {**CFG, "parallel": {"data": 2}, "train": {**CFG["train"], "profile_ranks": [1]}}
    run_on_ranks(2, _train, cfg, str(tmp_path), timeout=300)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank1.trace.json"]


@pytest.mark.parametrize("train,world,field", [({"profile_start": 0}, 1, "train.profile_start"),
                                               ({"profile_start": 4}, 1, "train.profile_start"),
                                               ({"profile_start": 1, "profile_steps": 0}, 1, "train.profile_steps"),
                                               ({"profile_start": 1, "profile_ranks": [2]}, 2, "train.profile_ranks"),
                                               ({"profile_memory": True}, 1, "train.profile_memory")])
def test_bad_profile_settings_are_refused(train, world, field):
    cfg = load_config({"model": {"preset": "tiny"}, "parallel": {"data": world},
                       "train": {"global_batch": 2 * world, "micro_batch": 1, "steps": 3, **train}})
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config(cfg, world)


def test_profile_ranks_all_is_every_rank():
    cfg = load_config({"model": {"preset": "tiny"}, "train": {"global_batch": 2, "micro_batch": 1, "steps": 3,
                                                              "profile_start": 1, "profile_ranks": "all"}})
    validate_config(cfg, 1)
    from gridshard.engine.profiling import Ranges, StepProfiler

    assert StepProfiler(cfg.train, 0, "/nonexistent", torch.device("cpu"), Ranges()).records


def test_memory_snapshots_after_the_profiled_steps_and_on_out_of_memory(tmp_path, monkeypatch):
    """train.profile_memory on a CUDA device (the allocator calls replaced: this machine has none): the
    history is recorded from the start, written after the profiled steps and on out-of-memory, and
    stopped when the run ends; a rank outside profile_ranks records nothing."""
    import gridshard.engine.profiling as profiling

    calls = []
    monkeypatch.setattr(profiling, "record_memory_history", lambda on: calls.append(("record", on)) or True)
    monkeypatch.setattr(profiling, "dump_memory_snapshot", lambda path: open(path, "w").close())
    cuda = torch.device("cuda")
    train = load_config({"train": {"steps": 4, "profile_memory": True, "profile_ranks": [1]}}).train
    assert not profiling.StepProfiler(train, 0, str(tmp_path), cuda, profiling.Ranges()).memory and calls == []
    watch = profiling.StepProfiler(train, 1, str(tmp_path), cuda, profiling.Ranges())      # no profile_start
    assert calls == [("record", True)]
    for k in range(4):
        watch.after_step(k)
    assert not (tmp_path / "profile").exists()                  # nothing is due without profiled steps
    assert watch.out_of_memory() == str(tmp_path / "profile" / "rank1.oom.memory.pickle")
    watch.finish()
    assert calls[-1] == ("record", False) and (tmp_path / "profile" / "rank1.oom.memory.pickle").exists()
    timed = load_config({"train": {"steps": 4, "profile_memory": True, "profile_start": 2, "profile_steps": 2}}).train
    prof = profiling.StepProfiler(timed, 0, str(tmp_path), cuda, profiling.Ranges())
    prof.after_step(1)
    assert not (tmp_path / "profile" / "rank0.memory.pickle").exists()
    prof.after_step(2)                                          # step 3, the last profiled one
    assert (tmp_path / "profile" / "rank0.memory.pickle").exists()
