"""Validation loss: the same at (D=4, none), (T=4, 1d), (T=4, 2d) and context parallelism
(C=2 ring × T=2 1d: each rank scores its chunks of every window), equal (fp32, 1e-5) to a
plain single-process computation on the gathered weights and the validation windows; the
split, the evaluation steps and the metrics line."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gridshard.config import resolve_config
from gridshard.data import load_split
from gridshard.engine import Trainer
from gridshard.models import ModelConfig, Transformer
from gridshard.testing import run_on_ranks

CFG = {"model": {"preset": "tiny"},
       "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 60_000, "val_fraction": 0.25},
       "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "log_interval": 2, "eval_interval": 1,
                 "eval_batches": 2, "lr": 3e-3, "warmup_steps": 1, "seed": 3}}
LAYOUTS = {"D4-none": {"data": 4}, "T4-1d": {"tensor": 4, "tensor_mode": "1d"},
           "T4-2d": {"tensor": 4, "tensor_mode": "2d"},
           "C2-T2-1d": {"context": 2, "tensor": 2, "tensor_mode": "1d"}}


def _body(cfg):
    from gridshard import gathered_state_dict

    trainer = Trainer(cfg, progress=False)
    trainer.run()
    state = gathered_state_dict(trainer.model)
    return [(h["step"], h.get("val_loss")) for h in trainer.history], state if trainer.rank == 0 else None


def _reference_val_loss(state, cfg) -> float:
    """Plain model, plain cross-entropy, windows drawn here from the documented law."""
    c = resolve_config({**cfg, "parallel": {}}, world_size=1)
    model = Transformer(ModelConfig(**vars(c.model.resolve())))
    model.load_state_dict(state)
    _, val = load_split(c.data)
    s, G = c.data.seq_len, c.train.global_batch
    total, n = 0.0, 0
    with torch.no_grad():
        for j in range(c.train.eval_batches):
            offs = np.random.Generator(np.random.PCG64([c.train.seed, j, 1])).integers(0, len(val) - s - 1, G,
                                                                                          endpoint=True)
            w = torch.from_numpy(np.stack([val[o:o + s + 1] for o in offs]).astype(np.int64))
            logits = model(w[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                           reduction="sum"))
            n += w[:, 1:].numel()
    return total / n


def test_validation_loss_is_the_same_at_every_layout():
    got = {}
    for name, parallel in LAYOUTS.items():
        cfg = {**CFG, "parallel": parallel}
        per_rank = run_on_ranks(4, _body, cfg, timeout=300)
        assert all(r[0] == per_rank[0][0] for r in per_rank), f"{name}: ranks disagree on val_loss"
        history, state = per_rank[0]
        # eval at 1 (logged for it) and 2 (a log step and the last step)
        assert [step for step, _ in history] == [1, 2]
        assert all(v is not None and v > 0 for _, v in history), history
        ref = _reference_val_loss(state, cfg)
        assert abs(history[-1][1] - ref) / ref < 1e-5, (name, history[-1][1], ref)
        got[name] = [v for _, v in history]
    base = got["D4-none"]
    for name, vals in got.items():
        assert max(abs(a - b) / b for a, b in zip(vals, base)) <= 1e-4, (name, vals, base)
    assert got["D4-none"][1] < got["D4-none"][0] + 0.5      # a sane number, not a constant


def test_split_and_eval_steps_without_validation():
    c = resolve_config({**CFG, "data": {**CFG["data"], "val_fraction": 0.25}}, world_size=1)
    train, val = load_split(c.data)
    assert len(train) + len(val) == 60_000 and len(val) == 15_000
    c0 = resolve_config({**CFG, "data": {**CFG["data"], "val_fraction": None}}, world_size=1)
    train0, val0 = load_split(c0.data)
    assert val0 is None and np.array_equal(train0[:len(train)], train)   # the cut keeps the prefix


@pytest.mark.parametrize("field,value,words", [
    ("val_fraction", 1.0, ["data.val_fraction=1.0", "[0, 1)"]),
    ("val_fraction", 0.0001, ["validation data holds 6 tokens", "data.val_fraction=0"]),
])
def test_bad_validation_settings_are_one_error(field, value, words):
    from gridshard.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve_config({**CFG, "data": {**CFG["data"], field: value}}, world_size=1)
    for w in words:
        assert w in str(e.value), str(e.value)
