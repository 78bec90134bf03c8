"""Issue 21, items 11-13: the Hugging Face export carries the run's tokenizer (and is readable by
the group); a resume names every incompatible field in one message and refuses a changed
learning-rate schedule unless ``--allow-changed-schedule``; ``gridshard train`` (and ``--check``)
prints the predicted peak memory per rank and refuses a layout that does not fit the machine.

One small real checkpoint is made once (module fixture): a 1-rank tiny run of 4 steps saving at
steps 2 and 4, in the persistent test worker (:func:`gridshard.testing.run_on_ranks`).
"""
import contextlib
import io
import json
import os
import re
import stat
import sys

import pytest
import yaml
from click.testing import CliRunner

from gridshard.checkpoint import CheckpointError
from gridshard.checkpoint.hf_tokenizer import byte_tokenizer, export_tokenizer, write_tokenizer_files
from gridshard.checkpoint.resume import check_compatible
from gridshard.cli import EXIT_CONFIG, main
from gridshard.config import resolve_config
from gridshard.data.tokenizer import ByteTokenizer
from gridshard.errors import ConfigError
from gridshard.planner import fit
from gridshard.testing import run_on_ranks

CFG = {"parallel": {"data": 1, "tensor": 1, "tensor_mode": "none"}, "model": {"preset": "tiny"},
       "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
       "train": {"global_batch": 4, "micro_batch": 4, "steps": 4, "warmup_steps": 1, "log_interval": 1,
                 "save_interval": 2, "eval_interval": 0}}
TEXT = "gridshard — héllo wörld, 日本語 and 🙂: naïve café\n\ttabs\x00"


# ---- one small real checkpoint, and the Trainer's own resume check ---------------------------------------
def _train_then_resume(run_dir):
    """Train CFG (checkpoints step_2, step_4); then resume step_2 with warm-up 1 -> 3: refused by the
    Trainer, accepted with train.allow_changed_schedule (log line, the new schedule's lr at step 3)."""
    from gridshard.engine import Trainer

    Trainer(CFG, run_dir=run_dir, progress=False).run()
    step_2 = os.path.join(run_dir, "checkpoints", "step_2")
    changed = {**CFG, "train": {**CFG["train"], "warmup_steps": 3, "resume": step_2}}
    out = {}
    try:
        Trainer(changed, progress=False)
        out["refused"] = None
    except CheckpointError as e:
        out["refused"] = str(e)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        allowed = Trainer({**changed, "train": {**changed["train"], "allow_changed_schedule": True}}, progress=False)
    out["log"] = err.getvalue()
    out["start"], (_, _, out["lr"]) = allowed.start_step, allowed.step(allowed.start_step)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("resume_rules") / "run")
    result = run_on_ranks(1, _train_then_resume, run_dir, timeout=300)[0]
    config = str(tmp_path_factory.mktemp("cfg") / "cfg.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(CFG, f)
    return {"run_dir": run_dir, "config": config, **result}




# ---- item 11: the export's tokenizer --------------------------------------------------------------------
def test_byte_tokenizer_file_encodes_and_decodes_like_the_byte_tokenizer():
    pytest.importorskip("tokenizers")
    ours, theirs = ByteTokenizer(), byte_tokenizer()
    assert theirs.get_vocab_size() == 256
    assert theirs.encode(TEXT).ids == ours.encode(TEXT) == list(TEXT.encode("utf-8"))
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    broken = [0xFF, 0x41, 0xE6, 0x97, 0x41, 0xF0, 0x9F, 0x99, 0x20, 0xC3]   # invalid and cut UTF-8 sequences
    assert theirs.decode(broken) == ours.decode(broken)
    every = list(range(256))
    assert theirs.decode(every) == ours.decode(every)


def _assert_readable_by_the_group(paths):
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o644, (p, oct(os.stat(p).st_mode))


def test_export_writes_a_tokenizer_transformers_loads_and_group_readable_files(run, tmp_path):
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from gridshard.checkpoint.hf_io import export_hf

    out = str(tmp_path / "hf")
    old = os.umask(0o077)                              # a private umask: files would be 0600
    try:
        paths = export_hf(os.path.join(run["run_dir"], "checkpoints", "step_4"), out)
    finally:
        os.umask(old)
    names = ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == names and sorted(os.path.basename(p) for p in paths) == names
    _assert_readable_by_the_group(paths)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.encode(TEXT)
    assert ids == ByteTokenizer().encode(TEXT)          # no BOS/EOS added, ids = bytes
    assert tok.decode(ids) == TEXT and tok.decode([0xFF, 0x41]) == ByteTokenizer().decode([0xFF, 0x41])


def test_prepared_bpe_tokenizer_is_exported_with_its_end_of_text_token(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from gridshard.data.prepare import FORMAT
    from gridshard.data.tokenizer import EOS, train_bpe

    bpe = train_bpe([TEXT * 3, "def main():\n    return 0\n" * 5], vocab_size=300)
    run_copy = tmp_path / "run" / "tokenizer"          # the run's copy of the prepared folder's tokenizer
    run_copy.mkdir(parents=True)
    bpe.tok.save(str(run_copy / "tokenizer.json"))
    (run_copy / "meta.json").write_text(json.dumps({"format": FORMAT, "tokenizer": {"kind": "hf",
                                                                                    "file": "tokenizer.json"}}))
    config = {"data": {"kind": "prepared", "path": str(tmp_path / "gone")}, "model": {"max_seq_len": 64}}
    out = tmp_path / "hf"
    out.mkdir()
    paths = export_tokenizer(config, str(tmp_path / "run" / "checkpoints" / "step_1"), str(out))
    assert (out / "tokenizer.json").read_bytes() == (run_copy / "tokenizer.json").read_bytes()
    assert len(paths) == 3
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode(TEXT) == bpe.encode(TEXT) and tok.decode(bpe.encode(TEXT)) == bpe.decode(bpe.encode(TEXT))
    assert tok.eos_token == EOS and tok.eos_token_id == bpe.eos_id == 0


def test_no_tokenizer_for_raw_ids_or_without_the_package_says_so_in_one_line(tmp_path, monkeypatch):
    notes = []
    tokens = {"data": {"kind": "tokens", "path": "x.bin"}, "model": {"max_seq_len": 64}}
    assert export_tokenizer(tokens, str(tmp_path / "step_1"), str(tmp_path), note=notes.append) == []
    monkeypatch.setitem(sys.modules, "tokenizers", None)          # `import tokenizers` raises ImportError
    text = {"data": {"kind": "stdlib"}, "model": {"max_seq_len": 64}}
    assert export_tokenizer(text, str(tmp_path / "step_1"), str(tmp_path), note=notes.append) == []
    assert len(notes) == 2 and all("\n" not in n and "no tokenizer written" in n and "Fix:" in n for n in notes)
    assert "data.kind=tokens" in notes[0] and "pip install -e .[data]" in notes[1]
    assert os.listdir(tmp_path) == []
    with pytest.raises(ImportError):
        write_tokenizer_files(str(tmp_path), ByteTokenizer(), 64)


# ---- item 12: resume rules -----------------------------------------------------------------------------
def _resolved(**sections):
    raw = {k: {**CFG[k], **sections.get(k, {})} for k in CFG}
    return resolve_config(raw, world_size=1, cuda_available=False).resolved()


def test_every_incompatible_field_is_named_in_one_message():
    saved = _resolved()
    other = _resolved(model={"hidden": 128, "layers": 3, "rope_theta": 500.0, "init_std": 0.01},
                      train={"global_batch": 8, "warmup_steps": 2}, data={"seq_len": 16})
    with pytest.raises(CheckpointError) as e:
        check_compatible(saved, other, "step_2", start_step=2)
    msg = str(e.value)
    for field, new, old in [("model.hidden", 128, 64), ("model.layers", 3, 2), ("model.rope_theta", 500.0, 10000.0),
                            ("model.init_std", 0.01, 0.02), ("train.global_batch", 8, 4), ("data.seq_len", 16, 32),
                            ("train.warmup_steps", 2, 1)]:
        assert f"{field} is {new!r} in this config but {old!r} in the checkpoint" in msg, (field, msg)
    assert msg.count("Fix:") == 1 and "\n" not in msg and "7 fields differ" in msg
    fix = msg.split("Fix:")[1]
    for override in ("model.hidden=64", "model.layers=2", "model.rope_theta=10000.0", "model.init_std=0.02",
                     "train.global_batch=4", "data.seq_len=32", "train.warmup_steps=1", "--allow-changed-schedule"):
        assert override in fix, (override, fix)


def test_which_schedule_changes_are_refused():
    saved = _resolved(train={"steps": 10, "warmup_steps": 2})

    def verdict(start=4, **train):
        try:
            return check_compatible(saved, _resolved(train={"steps": 10, "warmup_steps": 2, **train}), "step_4",
                                    start_step=start)
        except CheckpointError as e:
            return str(e)

    for train in ({"lr": 1e-3}, {"min_lr": 1e-5}, {"warmup_steps": 3}, {"schedule": "constant"}, {"decay_steps": 8},
                  {"steps": 20}):
        key, value = next(iter(train.items()))
        assert f"train.{key} is {value!r} in this config" in verdict(**train), train
    assert "train.decay_steps=10 to change train.steps on the same schedule" in verdict(steps=20)
    # the same rate at every remaining step: accepted, and named in the log
    assert verdict(steps=20, decay_steps=10) == ["train.decay_steps: None -> 10", "train.steps: 10 -> 20"]
    constant = _resolved(train={"steps": 10, "warmup_steps": 2, "schedule": "constant"})
    assert check_compatible(constant, _resolved(train={"steps": 30, "warmup_steps": 2, "schedule": "constant",
                                                       "min_lr": 0.0}), "step_4", start_step=4) == \
        ["train.min_lr: 0.0003 -> 0.0", "train.steps: 10 -> 30"]
    # a warm-up change after both warm-ups, constant rate: nothing changes
    assert check_compatible(constant, _resolved(train={"steps": 10, "warmup_steps": 3, "schedule": "constant"}),
                            "step_4", start_step=4) == ["train.warmup_steps: 2 -> 3"]
    assert verdict(warmup_steps=3, allow_changed_schedule=True) == \
        ["train.warmup_steps: 2 -> 3 (a new schedule, --allow-changed-schedule)"]
    assert verdict(micro_batch=2, weight_decay=0.0) == ["train.micro_batch: 4 -> 2", "train.weight_decay: 0.1 -> 0.0"]


def test_trainer_refuses_a_changed_schedule_and_names_an_allowed_one(run):
    from gridshard.schedule import lr_at

    assert "train.warmup_steps is 3 in this config but 1 in the checkpoint" in run["refused"]
    assert "--allow-changed-schedule" in run["refused"]
    assert re.search(r"resumed from \S*step_2 at step 2; changes: train.warmup_steps: 1 -> 3 "
                     r"\(a new schedule, --allow-changed-schedule\)", run["log"]), run["log"]
    t = resolve_config(CFG, world_size=1, cuda_available=False).train
    assert run["start"] == 2 and run["lr"] == lr_at(2, t.lr, t.min_lr, 3, t.steps, t.schedule) != \
        lr_at(2, t.lr, t.min_lr, 1, t.steps, t.schedule)


def test_cli_refuses_a_changed_schedule_before_launch_unless_allowed(run, no_launch):
    step_2 = os.path.join(run["run_dir"], "checkpoints", "step_2")
    args = ["train", run["config"], "--check", "--nproc", "1", "--resume", step_2, "train.warmup_steps=3"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == EXIT_CONFIG, refused.output
    assert refused.output.count("config error:") == 1
    assert "train.warmup_steps is 3 in this config but 1 in the checkpoint" in refused.output
    allowed = CliRunner().invoke(main, args + ["--allow-changed-schedule"])
    assert allowed.exit_code == 0, allowed.output
    assert "allow_changed_schedule: true" in allowed.output       # what the workers get


# ---- item 13: memory before launch ---------------------------------------------------------------------
HOST_23GB = fit.MemoryBudget(int(fit.HOST_USABLE_FRACTION * 23e9), int(23e9), "21.42 GiB host RAM shared by 1 local "
                             "process")
ONE = ["--nproc", "1", "parallel.data=1", "parallel.tensor=1", "parallel.tensor_mode=none"]


@pytest.fixture
def machine_23gb(monkeypatch):
    asked = []

    def budget(local, cuda=None):
        asked.append(local)
        return HOST_23GB
    monkeypatch.setattr(fit, "machine_budget", budget)
    return asked


@pytest.mark.parametrize("check", [True, False], ids=["check", "train"])
def test_7b_on_one_process_of_a_23gb_machine_is_refused(check, no_launch, machine_23gb, tmp_path):
    args = ["train", *ONE, "model.preset=7b", "--run-dir", str(tmp_path / "r")] + (["--check"] if check else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == EXIT_CONFIG, result.output
    out = result.output
    cfg = resolve_config(None, ONE[2:] + ["model.preset=7b"], world_size=1, cuda_available=False)
    predicted = fit.predicted_peak(cfg, HOST_23GB)[0].total_with_margin
    assert out.count("config error:") == 1 and f"{predicted} bytes" in out and f"{HOST_23GB.per_rank} bytes" in out
    assert "21.42 GiB host RAM" in out and "Fix:" in out and "no layout of 1" in out
    assert machine_23gb == [1] and not os.path.exists(tmp_path / "r")


def test_the_tiny_default_passes_and_prints_its_predicted_peak(no_launch, machine_23gb):
    result = CliRunner().invoke(main, ["train", "--check", "--nproc", "4"])
    assert result.exit_code == 0, result.output
    cfg = resolve_config(None, world_size=4, cuda_available=False)
    line = fit.check_memory(cfg, 4, HOST_23GB)
    assert f"# {line}" in result.output and "predicted peak memory per rank: " in line
    assert machine_23gb == [4]


def test_the_refusal_names_a_layout_that_fits_and_host_memory_is_shared(monkeypatch):
    budget = fit.MemoryBudget(int(0.9 * 23e9 / 4), int(23e9), "23 GB host RAM shared by 4 local processes", local=4)
    cfg = resolve_config(None, ["model.preset=125m", "parallel.data=4", "parallel.tensor=1", "parallel.tensor_mode=none",
                                "train.global_batch=16", "train.micro_batch=4", "data.seq_len=1024"],
                         world_size=4, cuda_available=False)
    with pytest.raises(ConfigError) as e:
        fit.check_memory(cfg, 4, budget)
    fix = re.search(r"the nearest layout that fits on 4 processes is .* per rank: set (.*?) \(", str(e.value))
    assert fix, str(e.value)
    better = resolve_config(cfg.model_dump(), fix.group(1).split(), world_size=4, cuda_available=False)
    assert "predicted peak memory per rank" in fit.check_memory(better, 4, budget)     # the named layout fits
    # the host's RAM is shared: four local workers get a quarter each
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 8 << 30)
    assert fit.machine_budget(4, cuda=False).per_rank == int(fit.HOST_USABLE_FRACTION * (8 << 30) / 4)


def test_host_memory_is_read_from_the_machine():
    total = fit.host_memory_bytes()
    assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") or 0.9 < total / (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) < 1.1
