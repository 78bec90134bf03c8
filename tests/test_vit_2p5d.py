"""A ViT trains at 2.5D exactly like one process: 10 steps of the tiny ViT of
:mod:`tests.test_vit_train` on the bundled digits at (D, P, T) = (1, 1, 8), q = 2, d = 2 give the
single-process run's per-step loss and gradient norm within 1e-5 relative (fp32, clipping active),
its validation loss and final gathered parameters within 1e-5 (relative Frobenius, every tensor but
the key biases, whose gradient is exactly zero and whose AdamW steps are rounding noise), and the
same training and validation accuracies; so does ZeRO-3 with selective recompute (ZeRO then shards
over the depth replicas), and (2, 1, 8) data parallelism at ZeRO-2 (16 ranks).

How: depth layer k of the 2.5D group is a 2D grid (q² = 4 ranks) with the same weights on image
batch block k·q + i of d·q = 4 (``ParallelContext.shard_tokens``, the same split as the Llama's
tokens); the reducer sums the gradients over data × depth and the accuracy counts over the same
ranks (docs/tp2p5d.md "In training"). Wide: 8 ranks. :func:`check_vit_run` is shared with
:mod:`tests.test_vit_3d`.
"""
import pytest

pytest.importorskip("sklearn")

from gridshard.testing import run_on_ranks  # noqa: E402
from gridshard.testing.compare import max_rel  # noqa: E402

from .test_vit_train import CFG, TOL  # noqa: E402

# micro_batch 4 = d·q (2.5D) = q² (3D): every batch block holds one image of each micro-batch
TRAIN = {**CFG["train"], "micro_batch": 4}


def _body(parallel, train):
    from gridshard import gathered_state_dict
    from gridshard.engine import Trainer

    trainer = Trainer({**CFG, "train": {**TRAIN, **train}, "parallel": parallel}, progress=False)
    losses = trainer.run()
    h = trainer.history
    return {"loss": losses, "norm": [r["grad_norm"] for r in h],
            "evals": [(r["accuracy"], r["val_accuracy"]) for r in h if "val_loss" in r],
            "val": [r["val_loss"] for r in h if "val_loss" in r], "params": gathered_state_dict(trainer.model),
            "blocks": (trainer.mesh.batch_blocks, trainer.mesh.batch_index, trainer.mesh.data_context.size)}


_REFERENCE = {}


def check_vit_run(parallel, train=None, ranks: int = 8) -> list:
    """Run the ViT at ``parallel`` (``ranks`` ranks) with ``train`` overrides and assert it is the one-process run
    (module docstring); returns every rank's ``blocks`` (batch blocks, my block, replica count)."""
    train = train or {}
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_on_ranks(1, _body, {}, {}, timeout=300)[0]
    ref = _REFERENCE["ref"]
    per_rank = run_on_ranks(ranks, _body, parallel, train, timeout=600)
    got = per_rank[0]
    for other in per_rank[1:]:
        assert [other[k] for k in ("loss", "norm", "evals", "val")] == \
            [got[k] for k in ("loss", "norm", "evals", "val")], "ranks disagree on losses / norms / accuracy"
    what = f"ViT {parallel} {train}"
    assert len(got["loss"]) == 10 and max(ref["norm"]) > CFG["train"]["grad_clip"], "clipping must be active"
    assert max_rel(got["loss"], ref["loss"]) <= TOL, f"{what}: losses {got['loss']} vs {ref['loss']}"
    assert max_rel(got["norm"], ref["norm"]) <= TOL, f"{what}: grad norms {got['norm']} vs {ref['norm']}"
    assert [len(e) for e in got["evals"]] == [2, 2] and got["evals"] == ref["evals"], \
        f"{what}: accuracy {got['evals']} vs {ref['evals']}"
    assert len(got["val"]) == 2 and max_rel(got["val"], ref["val"]) <= TOL, f"{what}: val_loss {got['val']}"
    params, ref_params = {}, ref["params"]
    for r in per_rank:                                # pipeline stages: each holds its own layers (global names)
        params.update(r["params"])
    assert sorted(params) == sorted(ref_params)
    # attention.key.bias has an exactly zero gradient (softmax(q·(k + c)) = softmax(q·k + q·c), the same shift for
    # every key of a query): what it gets is rounding noise that AdamW's normalisation turns into lr-sized steps,
    # different in every summation order and without effect on any output, so it is left out
    errors = {k: float((params[k].double() - v.double()).norm() / v.double().norm()) for k, v in ref_params.items()
              if not k.endswith("attention.key.bias")}
    assert len(errors) == len(ref_params) - CFG["model"]["layers"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{what}: final {worst} differs by {errors[worst]:.2e} ({errors})"
    print(f"\n{what}: loss {max_rel(got['loss'], ref['loss']):.1e}, grad norm {max_rel(got['norm'], ref['norm']):.1e}"
          f", val_loss {max_rel(got['val'], ref['val']):.1e}, params {errors[worst]:.1e} ({worst})")
    return [r["blocks"] for r in per_rank]


@pytest.mark.wide                      # 8 ranks
@pytest.mark.parametrize("train", [{}, {"zero": 3, "recompute": "selective"}], ids=["zero0", "zero3-selective"])
def test_vit_2p5d_training_matches_one_process(train):
    blocks = check_vit_run({"tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}, train)
    # every rank feeds its own batch block k·q + i of d·q = 4, and the gradients are summed over the 2 depth layers
    assert sorted(blocks) == sorted((4, 2 * k + i, 2) for k in range(2) for i in range(2) for _ in range(2))


@pytest.mark.wide                      # 16 ranks
def test_vit_2p5d_data_parallel_zero2_matches_one_process():
    """(D, P, T) = (2, 1, 8) at 2.5D (q = 2, d = 2), ZeRO-2: each data replica's 8 ranks read half the batch, depth
    layer k's grid position (i, j) its block k·q + i; the reducer sums over data × depth (4 ranks)."""
    blocks = check_vit_run({"data": 2, "tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}, {"zero": 2}, ranks=16)
    assert sorted(blocks) == sorted((4, 2 * k + i, 4) for k in range(2) for i in range(2) for _ in range(4))
