"""Training on packed windows with document masks (issue 41): 8 steps at each composition equal
one process, step by step.

Data: Python's standard library as bytes with ``data.eod_token: 32``, so every space ends a
document: many short documents per window (7 on average), a few longer than a window and cut; ``data.packing: first_fit`` (and
concat in one layout) with ``data.document_mask: true``, fp32, grouped-query heads (4 query heads,
2 k/v heads). The reference is the same config in one process, whose model is checked against each
document run alone in tests/test_packing.py; a layout differs from it only in summation order, so
1e-5 on losses and gradient norms per step. Recompute (full with ZeRO-3, selective with
``train.compile``) keeps the masks and tables exact too.

Before training, the batches are checked to hold what the test is about: several documents per
window, padding, and documents that cross the context chunks' boundaries.
"""
import numpy as np
import pytest

from gridshard.testing import run_on_ranks

STEPS, TOL = 8, 1e-5
MODEL = {"preset": None, "vocab_size": 256, "hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_hidden": 64,
         "max_seq_len": 64}
LAYOUTS = {  # name: (world size, parallel section, train overrides, data overrides)
    "1d-SP": (2, {"tensor": 2, "tensor_mode": "1d", "sequence_parallel": True}, {}, {}),
    "2d": (4, {"tensor": 4, "tensor_mode": "2d"}, {}, {}),
    "3d": (8, {"tensor": 8, "tensor_mode": "3d"}, {"micro_batch": 4}, {}),
    "C4-ring": (4, {"context": 4, "context_mode": "ring"}, {}, {}),
    "C2-all_to_all": (2, {"context": 2, "context_mode": "all_to_all"}, {}, {"packing": "concat"}),
    "P2-interleaved": (2, {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}, {}, {}),
    "D2-zero3-full": (2, {"data": 2}, {"zero": 3, "recompute": "full"}, {}),
    "T1-selective-compile": (1, {}, {"recompute": "selective", "compile": True}, {}),
}
QUICK = ("1d-SP", "C4-ring", "P2-interleaved")


def _config(parallel=None, train=None, data=None):
    return {"model": MODEL, "parallel": {"data": 1, "tensor": 1, "tensor_mode": "none", **(parallel or {})},
            "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 60_000, "packing": "first_fit",
                     "document_mask": True, "eod_token": 32, **(data or {})},
            "train": {"global_batch": 8, "micro_batch": 2, "steps": STEPS, "lr": 3e-3, "warmup_steps": 2,
                      "grad_clip": 0.5, "log_interval": 1, "seed": 3, "precision": "fp32", **(train or {})}}


def _train_body(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    losses = trainer.run()
    return losses, [r["grad_norm"] for r in trainer.history], [r["valid_tokens"] for r in trainer.history]


_REF = {}


def _reference(tmp_path_factory, data=None):
    key = tuple(sorted((data or {}).items()))
    if key not in _REF:
        _REF[key] = run_on_ranks(1, _train_body, _config(data=data), str(tmp_path_factory.mktemp("ref")),
                                 timeout=300)[0]
    return _REF[key]


def test_the_packed_batches_hold_what_the_test_is_about():
    from gridshard.config import resolve_config
    from gridshard.data import BatchPlan, load_split
    from gridshard.data.packing import split_packers

    d = resolve_config(_config(), world_size=1).data
    tokens, _ = load_split(d)
    packer, _ = split_packers(d, tokens, None)
    plan = BatchPlan(tokens, 32, 8, 8, 1, 0, 3, 256, None, packer=packer)
    docs = np.concatenate([plan.step_batches(k)[0][0][2].numpy() for k in range(STEPS)])
    per_row = docs.max(1) + 1
    assert per_row.mean() > 4 and (per_row == 1).any(), per_row        # many documents; a cut one fills a window
    c = 32 // 8                                                          # C = 4: chunks of 4 tokens
    crossing = (docs[:, c - 1::c][:, :-1] == docs[:, c::c]).mean()
    assert 0.3 < crossing < 1.0, crossing                                # documents cross chunk boundaries, not all


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.wide) for n in LAYOUTS])
def test_packed_document_masked_training_equals_one_process(name, tmp_path_factory):
    world, parallel, train, data = LAYOUTS[name]
    ref_loss, ref_norm, ref_valid = _reference(tmp_path_factory, data)
    per_rank = run_on_ranks(world, _train_body, _config(parallel, train, data), str(tmp_path_factory.mktemp(name)),
                            timeout=600)
    loss, norm, valid = per_rank[0]
    assert valid == ref_valid and valid[0] < 8 * 32, (valid, ref_valid)      # masked targets counted out
    dl = max(abs(a - b) / b for a, b in zip(loss, ref_loss))
    dn = max(abs(a - b) / b for a, b in zip(norm, ref_norm))
    print(f"{name}: loss {dl:.1e}, grad norm {dn:.1e}")
    assert dl <= TOL and dn <= TOL, (name, dl, dn)
    assert ref_loss[-1] < ref_loss[0]
