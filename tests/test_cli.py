"""The CLI rejects every bad config with one message and exit status 2, before any worker starts."""
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import gridshard.launch
from gridshard.cli import EXIT_CONFIG, main

# (name, CONFIG file text or None, extra args, words in the message)
BAD = [
    ("unknown key", None, ["train.lrr=0.1"], ["train.lrr", "did you mean train.lr"]),
    ("wrong type", None, ["parallel.data=two"], ["parallel.data", "an integer"]),
    ("world size", None, ["--nproc", "3"], ["world size is 3", "Fix"]),
    ("non-square 2d", None, ["--nproc", "2", "parallel.data=1", "parallel.tensor_mode=2d"], ["perfect square"]),
    ("heads vs tensor", None, ["--nproc", "8", "parallel.data=1", "parallel.tensor=8"], ["model.heads", "tensor=8"]),
    ("global batch", None, ["train.global_batch=12"], ["train.global_batch=12", "micro_batch"]),
    ("2d micro-batch", None, ["parallel.data=1", "parallel.tensor=4", "parallel.tensor_mode=2d", "train.micro_batch=3",
                              "train.global_batch=6"], ["train.micro_batch", "q=2"]),
    ("pipeline deeper than the model", None, ["parallel.pipeline=4", "--nproc", "16"],
     ["4 stages", "model.layers=2"]),
    ("negative lr", None, ["train.lr=-3e-4"], ["train.lr=-0.0003"]),
    ("missing data path", None, ["data.kind=tokens"], ["data.path", "needs a path"]),
    ("fp16 on CPU", None, ["train.precision=fp16"], ["train.precision", "bf16"]),
    ("SP with 2d", None, ["parallel.data=1", "parallel.tensor=4", "parallel.tensor_mode=2d",
                          "parallel.sequence_parallel=true"], ["parallel.sequence_parallel"]),
    ("bad override", None, ["train.lr"], ["does not exist", "train.lr=VALUE"]),
    ("yaml file typo", "parallel:\n  dta: 2\n", [], ["parallel.dta", "did you mean parallel.data"]),
    ("yaml not mapping", "- 1\n- 2\n", [], ["not a mapping"]),
    ("two configs", None, ["a.yaml", "b.yaml"], ["more than one CONFIG"]),
]


@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started for a bad config")
    monkeypatch.setattr(gridshard.launch, "launch_local", boom)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("name,text,args,words", BAD, ids=[b[0] for b in BAD])
def test_bad_config_exits_before_any_worker(name, text, args, words, tmp_path, no_launch):
    argv = ["train"]
    if text is not None:
        path = tmp_path / "cfg.yaml"
        path.write_text(text)
        argv.append(str(path))
    result = CliRunner().invoke(main, argv + args)
    assert result.exit_code == EXIT_CONFIG, (result.exit_code, result.output, result.exception)
    out = result.output
    assert out.count("config error:") == 1, out
    for w in words:
        assert w in out, f"{name}: {w!r} not in {out!r}"


# gridshard plan: requests that cannot be planned (args, words in the one-line message)
BAD_PLAN = [
    ("no devices", ["--gpus", "0"], ["--gpus 0 is invalid", "at least 1 device", "Fix: --gpus N"]),
    ("negative devices", ["--gpus", "-8"], ["--gpus -8 is invalid"]),
    ("no nodes", ["--gpus", "8", "--nodes", "0"], ["--nodes 0 is invalid", "Fix: --nodes 1"]),
    ("more nodes than devices", ["--gpus", "8", "--nodes", "16"], ["--nodes 16 is more than --gpus 8"]),
    ("nodes not dividing", ["--gpus", "8", "--nodes", "3"], ["--nodes 3 does not divide --gpus 8", "1, 2, 4, 8"]),
    ("over-full node", ["--gpus", "64", "--nodes", "1", "--hardware", "h100"],
     ["puts 64 devices on a node", "h100 node has 8", "Fix: --nodes 8"]),
    ("no rows", ["--gpus", "4", "--top", "0"], ["--top 0 is invalid", "at least 1"]),
    ("no sequences", ["--gpus", "4", "train.global_batch=0"], ["train.global_batch=0 is invalid", ">= 1"]),
    ("negative micro-batch", ["--gpus", "4", "train.micro_batch=-2"], ["train.micro_batch=-2 is invalid"]),
]


@pytest.mark.parametrize("name,args,words", BAD_PLAN, ids=[b[0] for b in BAD_PLAN])
def test_bad_plan_request_is_refused_before_pricing(name, args, words, monkeypatch):
    import gridshard.planner.search as search

    def boom(*a, **k):
        raise AssertionError("a layout was priced for a request that cannot be planned")
    monkeypatch.setattr(search, "evaluate", boom)
    result = CliRunner().invoke(main, ["plan", "configs/tiny.yaml"] + args)
    assert result.exit_code == EXIT_CONFIG, (result.exit_code, result.output, result.exception)
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("gridshard plan: ") and "Fix:" in lines[0], result.output
    for w in words:
        assert w in lines[0], f"{name}: {w!r} not in {lines[0]!r}"


def test_check_prints_the_resolved_config(no_launch):
    result = CliRunner().invoke(main, ["train", "--check", "--nproc", "4", "parallel.tensor_mode=1d",
                                       "train.steps=7"])
    assert result.exit_code == 0, result.output
    assert "steps: 7" in result.output and "hidden: 64" in result.output and "ok for 4 process(es)" in result.output


def test_help_texts_stand_alone():
    runner = CliRunner()
    top = runner.invoke(main, ["--help"]).output
    assert "train" in top and "plot" in top and "--nproc 4" in top
    tr = runner.invoke(main, ["train", "--help"]).output
    for word in ("--nproc", "--run-dir", "key.sub=value", "torchrun", "parallel.tensor_mode", "docs/config.md"):
        assert word in tr
    assert "metrics.jsonl" in runner.invoke(main, ["plot", "--help"]).output


def test_plot_of_a_missing_run_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert result.exit_code == EXIT_CONFIG and "metrics.jsonl" in result.output


def test_real_process_exits_nonzero_with_one_message():
    exe = os.path.join(os.path.dirname(sys.executable), "gridshard")
    proc = subprocess.run([exe, "train", "--nproc", "4", "parallel.tensor=3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == EXIT_CONFIG
    assert proc.stderr.count("config error:") == 1 and "2×1×3 = 6" in proc.stderr and "world size is 4" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
