"""The whole training run is the same at every layout: 30 steps, same seed and data,
per-step loss and per-step global gradient norm match the single-process run (fp32).

Clipping is active (grad_clip below the typical norm), so a gradient norm that counted
a replicated parameter twice (or missed a shard) would change the trajectory; the
global batch uses 2 micro-batches on one data rank and 1 on two, so gradient
accumulation and data-parallel averaging are both exercised.
"""
import pytest

from gridshard.engine import Trainer
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 30, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5,
                  "grad_clip": 0.5, "log_interval": 1, "seed": 7, "precision": "fp32"}}

LAYOUTS = {  # name: (D, T, mode, sequence_parallel)
    "D1-T1-none": (1, 1, "none", False),
    "D2-T1-none": (2, 1, "none", False),
    "D1-T2-1d": (1, 2, "1d", False),
    "D1-T2-1d-SP": (1, 2, "1d", True),
    "D1-T4-2d": (1, 4, "2d", False),
    "D2-T2-1d": (2, 2, "1d", False),
    "D2-T4-2d": (2, 4, "2d", False),      # data parallelism composed with the q×q grid (8 ranks)
}
# global batch 8 = 2 data ranks × 2 micro-batches of 2: data parallelism AND accumulation
# (the overlapped reduction must be armed at the LAST micro-batch: arming it at the first
# puts the gradient norm off by ~70%), also with sequence parallelism; reference: D=1, 4
# micro-batches of the same global batch
BASE_ACC = {**BASE, "train": {**BASE["train"], "global_batch": 8}}
LAYOUTS_ACC = {
    "D2-T1-none-acc2": (2, 1, "none", False),
    "D2-T2-1d-SP-acc2": (2, 2, "1d", True),
}


def _config(D, T, mode, sp, base=BASE):
    return {**base, "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp}}


def _train_body(cfg):
    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    return losses, [h["grad_norm"] for h in trainer.history], [h["lr"] for h in trainer.history]


_RESULTS = {}


def _run(name, base=BASE):
    if name not in _RESULTS:
        D, T, mode, sp = {**LAYOUTS, **LAYOUTS_ACC, "D1-T1-none-gb8": (1, 1, "none", False)}[name]
        per_rank = run_on_ranks(D * T, _train_body, _config(D, T, mode, sp, base), timeout=300)
        for other in per_rank[1:]:
            assert other == per_rank[0], f"{name}: ranks disagree on the loss/grad-norm history"
        _RESULTS[name] = per_rank[0]
    return _RESULTS[name]


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_reference_run_learns():
    losses, norms, lrs = _run("D1-T1-none")
    assert len(losses) == len(norms) == 30
    assert losses[-1] < 0.75 * losses[0], losses
    assert max(norms) > 0.5, "clipping must be active for this test to check the norm"
    assert lrs[0] == pytest.approx(3e-3 / 5)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "D1-T1-none"])
def test_layout_gives_the_same_run(name):
    ref_loss, ref_norm, ref_lr = _run("D1-T1-none")
    loss, norm, lr = _run(name)
    assert lr == ref_lr
    assert _max_rel(loss, ref_loss) <= 1e-4, f"{name}: loss differs by {_max_rel(loss, ref_loss):.2e}"
    assert _max_rel(norm, ref_norm) <= 1e-4, f"{name}: grad norm differs by {_max_rel(norm, ref_norm):.2e}"


@pytest.mark.parametrize("name", list(LAYOUTS_ACC))
def test_layout_gives_the_same_run_with_accumulation(name):
    ref_loss, ref_norm, ref_lr = _run("D1-T1-none-gb8", BASE_ACC)
    loss, norm, lr = _run(name, BASE_ACC)
    assert lr == ref_lr
    # fp32, 30 steps: only summation orders differ (D1 layouts above stay ≤ 3e-6)
    assert _max_rel(loss, ref_loss) <= 1e-4, f"{name}: loss differs by {_max_rel(loss, ref_loss):.2e}"
    assert _max_rel(norm, ref_norm) <= 1e-4, f"{name}: grad norm differs by {_max_rel(norm, ref_norm):.2e}"
