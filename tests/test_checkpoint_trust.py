"""Issue 21, "one way to read a checkpoint": every attack and every kind of damage planted in a
checkpoint is refused by every reader — resume (the launcher's check before workers start, and
``Checkpointer.load`` in a worker), ``model.init_from``, ``gridshard generate`` and ``gridshard
export`` — with one CheckpointError (exit status 2 from the CLI, no traceback); no planted code
runs and nothing outside the run directory is read or printed.

One small real checkpoint is written once (2 ranks, (data=1, tensor=2, 1d)); each attack works
on a copy of its run directory. Attacks that rewrite files also rewrite ``manifest.json`` (as an
attacker would: the manifest is no authenticity check), so only the reader's own rules stand in
the way. The CLI commands run in-process (``click.testing.CliRunner``), one through a real
subprocess.
"""
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from gridshard.checkpoint import CheckpointError
from gridshard.checkpoint import files as F
from gridshard.cli import _check_resume, last_good_checkpoint, main, stopped_message
from gridshard.config import resolve_config
from gridshard.engine import Trainer
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

CFG = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 60_000},
       "parallel": {"data": 1, "tensor": 2, "tensor_mode": "1d"},
       "train": {"global_batch": 4, "micro_batch": 4, "steps": 1, "log_interval": 1, "seed": 3}}
SECRET = "root:x:0:0:TOP-SECRET-LINE-7f3a"          # stands for /etc/passwd: must never be printed


def _write_body(run_dir):
    trainer = Trainer(CFG, run_dir=run_dir, progress=False)
    trainer.run()
    state = gathered_state_dict(trainer.model)
    return state if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The genuine run (its step_1 and the weights saved in it), and a secret file outside it."""
    base = tmp_path_factory.mktemp("trust")
    run_dir = str(base / "source")
    state = run_on_ranks(2, _write_body, run_dir, timeout=240)[0]
    secret = base / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    return {"run": run_dir, "step": os.path.join(run_dir, "checkpoints", "step_1"), "state": state,
            "secret": str(secret), "marker": str(base / "PWNED")}


# ---- the attacks: each takes a copy of the run, plants itself, returns the path a reader is given --
class _Shell:
    """A pickle that runs a shell command when unpickled."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _touch(src):
    return _Shell("touch " + shlex.quote(src["marker"]))


def _load_genuine_metadata(step):
    with open(os.path.join(step, ".metadata"), "rb") as f:
        return pickle.load(f)                         # our own checkpoint, written by DCP: trusted here


def _dump_metadata(step, md):
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    F.write_manifest(step)                            # the attacker recomputes the manifest


def plain_pickle(run, step, src):
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(_touch(src), f)
    F.write_manifest(step)
    return step


def bytes_entry(run, step, src):
    """DCP's own BytesStorageMetadata (a class of DCP's metadata module) for a model tensor,
    dressed with the tensor's size and dtype, pointing at a payload file of the folder that
    holds a pickled os.system call: DCP's default planner would torch.load it with
    weights_only=False."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = _load_genuine_metadata(step)
    fqn = "model.norm.weight"
    real, evil = md.state_dict_metadata[fqn], BytesStorageMetadata()
    evil.size, evil.properties, evil.chunks = real.size, real.properties, real.chunks
    md.state_dict_metadata[fqn] = evil
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
    payload = os.path.join(step, "__7_0.distcp")
    with open(payload, "wb") as f:
        pickle.dump(_touch(src), f)
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo("__7_0.distcp", 0, os.path.getsize(payload))
    _dump_metadata(step, md)
    return step


def chunk_outside(run, step, src):
    """DCP's index placing a chunk in a file outside the folder (``../../..``)."""
    md = _load_genuine_metadata(step)
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    info.relative_path = os.path.relpath(src["secret"], step)
    info.offset, info.length = 0, len(SECRET)
    _dump_metadata(step, md)
    return step


def _write_latest(run, content):
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write(content)
    return run


def latest_dotdot(run, step, src):
    shutil.copytree(step, os.path.join(run, "elsewhere"))
    return _write_latest(run, "../elsewhere\n")       # the run's own copy: still refused, it is not step_N


def latest_absolute(run, step, src):
    return _write_latest(run, src["step"] + "\n")     # a genuine checkpoint, but outside this run


def latest_symlink(run, step, src):
    os.remove(os.path.join(run, "checkpoints", "latest"))
    os.symlink(src["secret"], os.path.join(run, "checkpoints", "latest"))
    return run


def step_symlink(run, step, src):
    shutil.rmtree(step)
    os.symlink(src["step"], step)                     # latest ("step_1") names a link out of the run
    return step


def file_symlink(run, step, src):
    name = sorted(n for n in os.listdir(step) if n.endswith(".distcp"))[0]
    os.remove(os.path.join(step, name))
    os.symlink(os.path.join(src["step"], name), os.path.join(step, name))
    return step


def meta_vocab(run, step, src):
    """meta.json says vocabulary 300 beside a 256-row embedding (manifest recomputed)."""
    path = os.path.join(step, "meta.json")
    meta = json.load(open(path))
    meta["config"]["model"]["vocab_size"] = 300
    json.dump(meta, open(path, "w"))
    F.write_manifest(step)
    return step


def _chunk(step, last=False):
    return os.path.join(step, sorted(n for n in os.listdir(step) if n.endswith(".distcp"))[-1 if last else 0])


def flipped_byte(run, step, src):
    path = _chunk(step, last=True)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x7F]))
    return step


def truncated_chunk(run, step, src):
    path = _chunk(step)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return step


def deleted_chunk(run, step, src):
    os.remove(_chunk(step))
    return step


def missing_manifest(run, step, src):
    os.remove(os.path.join(step, "manifest.json"))
    return step


def garbage_manifest(run, step, src):
    with open(os.path.join(step, "manifest.json"), "w") as f:
        f.write('{"files": {"meta.json": 5, ".metadata": [1]}}')
    return step


def edited_meta(run, step, src):
    """The data position edited, same size (only the hash can tell)."""
    path = os.path.join(step, "meta.json")
    text = open(path).read()
    assert '"samples": 4' in text
    open(path, "w").write(text.replace('"samples": 4', '"samples": 8'))
    return step


# attack → words its refusal must contain
ATTACKS = {
    plain_pickle: "is not allowed in a checkpoint's .metadata",
    bytes_entry: "BytesStorageMetadata",
    chunk_outside: "which is not a chunk file of the folder",
    latest_dotdot: "does not hold a step_N folder name",
    latest_absolute: "does not hold a step_N folder name",
    latest_symlink: "is a symbolic link",
    step_symlink: "symbolic link",
    file_symlink: "is a symbolic link",
    meta_vocab: "meta.json does not belong to these tensors",
    flipped_byte: "does not match its sha256",
    truncated_chunk: "(truncated or overwritten)",
    deleted_chunk: "is missing",
    missing_manifest: "manifest.json is missing",
    garbage_manifest: "is not a valid manifest",
    edited_meta: "meta.json does not match its sha256",
}
LATEST_ATTACKS = (latest_dotdot, latest_absolute, latest_symlink)      # they act through `latest`


def _planted(src, tmp_path, attack):
    run = str(tmp_path / "run")
    shutil.copytree(src["run"], run, symlinks=True)
    step = os.path.join(run, "checkpoints", "step_1")
    return run, attack(run, step, src)


def _assert_refused(message, attack, src):
    assert ATTACKS[attack] in message, message
    assert "Fix:" in message and "\n" not in message.strip(), message
    assert "TOP-SECRET" not in message, message       # nothing a refused file holds is printed
    assert not os.path.exists(src["marker"]), "planted code ran"


def _resume_cfg(src, resume):
    """The source run's own config (so only the checkpoint can be refused), resuming from ``resume``."""
    return resolve_config(os.path.join(src["run"], "config.yaml"), [f"train.resume={resume}"], world_size=2)


def _cli(args):
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{type(result.exception).__name__}: {result.exception}"          # an exception that escaped the CLI
    return result


@pytest.mark.parametrize("attack", list(ATTACKS), ids=[a.__name__ for a in ATTACKS])
def test_every_in_process_reader_refuses(source, tmp_path, attack):
    """The launcher's resume check (train --resume), generate and export, on the planted run
    (through ``latest``) or the planted folder: one CheckpointError / exit status 2 each."""
    run, target = _planted(source, tmp_path, attack)
    via_latest = attack in LATEST_ATTACKS or attack is step_symlink
    # resume, as the launcher checks it before any worker starts (--resume latest / a folder)
    with pytest.raises(CheckpointError) as info:
        _check_resume(_resume_cfg(source, "auto" if via_latest else target), run)
    _assert_refused(str(info.value), attack, source)
    # generate and export (CLI, in-process): exit status 2, one line, no traceback
    for args in (["generate", run if via_latest else target, "--prompt", "ab", "--max-new-tokens", "2"],
                 ["export", run if via_latest else target, "--to", "hf", str(tmp_path / "hf")]):
        result = _cli(args)
        assert result.exit_code == 2, (args[0], result.output)
        assert "Traceback" not in result.output
        _assert_refused(result.output.strip().removeprefix("error: "), attack, source)
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")


def _worker_readers_body(cases, model):
    """Every case through the worker-side readers at (data=2): resume (``Checkpointer.load`` via
    ``train.resume``) and ``model.init_from``; (reader, case, error type, message) for each."""
    out = []
    for name, run_dir, path, via_latest in cases:
        base = {**CFG, "parallel": {"data": 2, "tensor": 1}, "model": dict(model),
                "train": {**CFG["train"], "micro_batch": 2}}
        tries = [("resume", {**base, "train": {**base["train"], "resume": "auto" if via_latest else path}},
                  run_dir if via_latest else None)]
        if not via_latest:
            tries.append(("init_from", {**base, "model": {**model, "init_from": path}}, None))
        for reader, cfg, rd in tries:
            if name == "meta_vocab" and reader == "resume":       # a config that agrees with the edited meta.json
                cfg = {**cfg, "model": {**model, "vocab_size": 300}}
            try:
                Trainer(cfg, run_dir=rd, progress=False)
                out.append((reader, name, None, ""))
            except Exception as e:   # noqa: BLE001
                out.append((reader, name, type(e).__name__, str(e)))
    return out


def test_resume_and_init_from_in_a_worker_refuse_every_attack(source, tmp_path):
    cases = []
    for attack in ATTACKS:
        run, target = _planted(source, tmp_path / attack.__name__, attack)
        cases.append((attack.__name__, run, target, attack in LATEST_ATTACKS or attack is step_symlink))
    per_rank = run_on_ranks(2, _worker_readers_body, cases, CFG["model"], timeout=240)
    assert per_rank[0] == per_rank[1]                 # the ranks agree on every verdict (one gather)
    results = per_rank[0]
    by_name = {a.__name__: a for a in ATTACKS}
    assert len(results) == 2 * len(cases) - sum(c[3] for c in cases)
    for reader, name, kind, message in results:
        assert kind == "CheckpointError", (reader, name, kind, message)
        _assert_refused(message, by_name[name], source)


def test_each_layer_alone_refuses_a_bytes_entry(source, tmp_path, monkeypatch):
    """Defence in depth: with BytesStorageMetadata let through the allow-list, the check that
    every entry is a tensor refuses it; and a bytes read item never reaches torch.load."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from gridshard.checkpoint.reader import _CheckedReader, _TensorOnlyPlanner, open_checkpoint

    run, target = _planted(source, tmp_path, bytes_entry)
    monkeypatch.setitem(F._ALLOWED, "torch.distributed.checkpoint.metadata",
                        F._ALLOWED["torch.distributed.checkpoint.metadata"] | {"BytesStorageMetadata"})
    with pytest.raises(CheckpointError, match="is a BytesStorageMetadata, not a tensor: gridshard checkpoints hold "
                                              "tensors only"):
        open_checkpoint(target)
    monkeypatch.undo()
    checked = open_checkpoint(source["step"])
    index = MetadataIndex("model.norm.weight")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="not a tensor"):
        _CheckedReader(checked).read_data(LoadPlan([item]), None)
    with pytest.raises(CheckpointError, match="not a tensor"):
        _TensorOnlyPlanner({}).load_bytes(item, None)
    assert not os.path.exists(source["marker"])


def test_dcp_reads_tensor_chunks_with_weights_only():
    """The platform fact the reader rests on (torch 2.13): DCP's file reader loads tensor chunks
    with ``torch.load(weights_only=True)``; only bytes items (refused above) go elsewhere. A
    torch upgrade that changes this fails here, not silently."""
    import inspect

    from torch.distributed.checkpoint import FileSystemReader

    source = inspect.getsource(FileSystemReader.read_data)
    assert "weights_only=True" in source and "weights_only=False" not in source


# ---- the clean checkpoint reads, at another layout too (item 6) ---------------------------------
def _init_from_body(path):
    cfg = {**CFG, "parallel": {"data": 2, "tensor": 1}, "model": {**CFG["model"], "init_from": path},
           "train": {**CFG["train"], "micro_batch": 2}}
    trainer = Trainer(cfg, progress=False)
    state = gathered_state_dict(trainer.model)
    return state if dist.get_rank() == 0 else None


def test_init_from_a_gridshard_checkpoint_at_another_layout_gives_its_weights(source):
    """Written at (data=1, tensor=2, 1d), read at (data=2, tensor=1): exactly the saved weights
    (before: AttributeError, the optimizer was used before it existed)."""
    loaded = run_on_ranks(2, _init_from_body, source["step"], timeout=240)[0]
    assert loaded.keys() == source["state"].keys()
    assert all(torch.equal(loaded[k], source["state"][k]) for k in loaded)


def test_the_genuine_checkpoint_passes_every_reader(source, tmp_path):
    """The control: the same readers accept the untouched checkpoint (init_from: above)."""
    _check_resume(_resume_cfg(source, "auto"), source["run"])
    result = _cli(["generate", source["run"], "--prompt", "ab", "--max-new-tokens", "2"])
    assert result.exit_code == 0 and "step 1" in result.output, result.output
    result = _cli(["export", source["run"], "--to", "hf", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.embed_tokens.weight"], source["state"]["embed_tokens.weight"])


# ---- a damaged `latest` is found before launch; advice names the newest that verifies (item 8) ---
def test_damaged_latest_is_refused_before_launch_naming_the_newest_good_checkpoint(source, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(source["run"], run)
    root = os.path.join(run, "checkpoints")
    good, damaged = os.path.join(root, "step_1"), os.path.join(root, "step_2")
    shutil.copytree(good, damaged)                    # a genuine-looking step_2 ...
    meta = json.load(open(os.path.join(damaged, "meta.json")))
    meta["step"], meta["samples"] = 2, 8
    json.dump(meta, open(os.path.join(damaged, "meta.json"), "w"))
    F.write_manifest(damaged)
    F.update_latest(root, "step_2")
    flipped_byte(run, damaged, source)                # ... then one bit of it rots (sizes unchanged)
    with pytest.raises(CheckpointError) as info:      # the full check (sha256), in the launcher
        _check_resume(_resume_cfg(source, "auto"), run)
    message = str(info.value)
    assert "step_2" in message and "does not match its sha256" in message, message
    assert f"--resume {good}" in message and "--resume latest" not in message, message
    # the messages after a failure or a stop name the same checkpoint, not the damaged `latest`
    for line in (last_good_checkpoint(run), stopped_message(run)):
        assert f"last complete checkpoint: {good} " in line and f"--resume {good}" in line, line
        assert "--resume latest" not in line and "step_2, which `latest` names, does not verify" in line, line


# ---- one real process: a deleted chunk (before: a 67-line traceback) ------------------------------
def test_generate_on_a_deleted_chunk_exits_2_with_one_line(source, tmp_path):
    run, target = _planted(source, tmp_path, deleted_chunk)
    exe = os.path.join(os.path.dirname(sys.executable), "gridshard")
    proc = subprocess.run([exe, "generate", target, "--prompt", "ab", "--max-new-tokens", "2"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is missing" in proc.stderr and "Nothing was loaded" in proc.stderr
