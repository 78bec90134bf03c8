"""Training a ViT on the bundled digits (issue 26) is the same run at every layout: 10 steps of
a tiny ViT at (D, T, mode) = (4, 1, none), (1, 4, 1d), (2, 2, 1d + SP) and (1, 4, 2d) give the
single-process run's per-step loss and gradient norm within 1e-5 relative (fp32; clipping is
active, so a gradient counted twice or missed would move the trajectory), and the metrics carry
``accuracy`` and ``val_accuracy``; so do 2 × 2 (1d) with ZeRO-3 and 4 data ranks with ZeRO-1. Only the
2D run is in ``make test``; the others are wide. Pipeline stages too: (2, 2, none) — D = 2, P = 2 —
in ``make test``; P = 2 with 1D, 1D + SP and 2D inside the stages, GPipe, and ZeRO-1 over D = 2, wide."""
import pytest

pytest.importorskip("sklearn")

from gridshard.engine import Trainer  # noqa: E402
from gridshard.testing import run_on_ranks  # noqa: E402
from gridshard.testing.compare import max_rel  # noqa: E402
from gridshard.testing.train_cache import TrainCache  # noqa: E402

# 12×12 images in 4×4 patches: 10 tokens (sequence parallelism at T=2); hidden 32 = 8·q² (2D, q=2)
CFG = {"model": {"kind": "vit", "image_size": 12, "patch_size": 4, "channels": 1, "num_classes": 10, "hidden": 32,
                 "layers": 2, "heads": 4, "ffn_hidden": 64},
       "data": {"kind": "digits"},
       "train": {"global_batch": 8, "micro_batch": 2, "steps": 10, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                 "grad_clip": 0.5, "log_interval": 1, "seed": 7, "precision": "fp32", "eval_interval": 5,
                 "eval_batches": 2}}
TOL = 1e-5


def _config(D, T, mode, sp, zero=0, P=1, schedule="1f1b"):
    return {**CFG, "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp, "pipeline": P,
                                "pipeline_schedule": schedule},
            "train": {**CFG["train"], "zero": zero}}


def _train_body(cfg):
    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    evals = [(h["accuracy"], h["val_accuracy"]) for h in trainer.history if "val_loss" in h]
    return losses, [h["grad_norm"] for h in trainer.history], evals


_RUNS = TrainCache(_train_body, agree="all", what="losses / norms / accuracy", timeout=300)


def _run(D=1, T=1, mode="none", sp=False, zero=0, P=1, schedule="1f1b"):
    return _RUNS(_config(D, T, mode, sp, zero, P, schedule))


def _check(layout):
    ref_loss, ref_norm, ref_evals = _run()
    loss, norm, evals = _run(*layout)
    assert len(loss) == 10 and max(ref_norm) > CFG["train"]["grad_clip"], "clipping must be active"
    assert max_rel(loss, ref_loss) <= TOL, f"{layout}: losses {loss} vs {ref_loss}"
    assert max_rel(norm, ref_norm) <= TOL, f"{layout}: grad norms {norm} vs {ref_norm}"
    assert [len(e) for e in evals] == [2, 2] and evals == ref_evals, f"{layout}: accuracy {evals} vs {ref_evals}"
    assert all(0.0 <= a <= 1.0 for e in evals for a in e)


def test_vit_2d_training_matches_one_process():
    _check((1, 4, "2d", False))


@pytest.mark.wide
@pytest.mark.parametrize("layout", [(4, 1, "none", False), (1, 4, "1d", False), (2, 2, "1d", True),
                                    (2, 2, "1d", False, 3), (4, 1, "none", False, 1)])     # + ZeRO-3, ZeRO-1
def test_vit_training_matches_one_process(layout):
    _check(layout)


def test_vit_pipeline_training_matches_one_process():
    """(D, P, T) = (2, 2, none): two stages (embeddings + layer 0 | layer 1 + head), 1F1B."""
    _check((2, 1, "none", False, 0, 2))


@pytest.mark.wide
@pytest.mark.parametrize("layout", [(1, 2, "1d", False, 0, 2), (1, 2, "1d", True, 0, 2), (1, 4, "2d", False, 0, 2),
                                    (1, 1, "none", False, 0, 2, "gpipe"), (2, 1, "none", False, 1, 2)],
                         ids=["P2-T2-1d", "P2-T2-1d-SP", "P2-T4-2d", "P2-gpipe", "D2-P2-zero1"])
def test_vit_pipeline_with_tensor_layouts_matches_one_process(layout):
    _check(layout)


def _save_and_predict(run_dir, images):
    cfg = {**CFG, "train": {**CFG["train"], "steps": 3, "eval_interval": 0}}
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.run()
    trainer.model.eval()
    import torch

    with torch.no_grad():
        return trainer.model(images)


def test_export_loads_in_hugging_face_with_the_same_logits(tmp_path):
    """``gridshard export`` of a trained ViT's checkpoint loads in ``ViTForImageClassification``
    (its own legacy-name conversion) and gives the trained model's logits."""
    pytest.importorskip("transformers")
    import torch
    from transformers import ViTForImageClassification

    from gridshard.checkpoint import resolve_checkpoint
    from gridshard.checkpoint.hf_io import export_hf
    from gridshard.testing.compare import relative_error

    images = torch.randn(5, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    logits = run_on_ranks(1, _save_and_predict, str(tmp_path / "run"), images, timeout=300)[0]
    export_hf(resolve_checkpoint(str(tmp_path / "run"), None), str(tmp_path / "hf"))
    hf = ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert relative_error(hf(pixel_values=images).logits, logits) <= TOL


def _train_saving(D, T, mode, run_dir, resume, P=1):
    cfg = {**CFG, "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "pipeline": P},
           "train": {**CFG["train"], "save_interval": 5, "eval_interval": 0, "resume": resume}}
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    return trainer.run(), trainer.start_step


@pytest.mark.wide             # ~13 s of 4-rank training; make test reads ViT checkpoints in the export / predict tests
def test_checkpoint_saved_at_2d_resumes_at_1d_exactly(tmp_path):
    """Steps 6–10 resumed at (1, 4, 1d) from step 5 of a (1, 4, 2d) run are the single-process
    run's steps 6–10 (parameters, AdamW moments and the data position all carried over)."""
    ref_loss = _run()[0]
    run_on_ranks(4, _train_saving, 1, 4, "2d", str(tmp_path / "grid"), "never", timeout=300)
    step5 = str(tmp_path / "grid" / "checkpoints" / "step_5")
    losses, start = run_on_ranks(4, _train_saving, 1, 4, "1d", str(tmp_path / "row"), step5, timeout=300)[0]
    assert start == 5 and len(losses) == 5
    assert max_rel(losses, ref_loss[5:]) <= TOL, f"resumed {losses} vs {ref_loss[5:]}"


@pytest.mark.wide
def test_checkpoint_saved_with_pipeline_stages_resumes_at_1d_exactly(tmp_path):
    """A (2, 2, none) pipeline run's step-5 checkpoint (each stage saving its own layers under their
    global names) resumes at (1, 2, 1d) as the single-process run's steps 6–10."""
    ref_loss = _run()[0]
    run_on_ranks(4, _train_saving, 2, 1, "none", str(tmp_path / "pipe"), "never", 2, timeout=300)
    step5 = str(tmp_path / "pipe" / "checkpoints" / "step_5")
    losses, start = run_on_ranks(2, _train_saving, 1, 2, "1d", str(tmp_path / "row"), step5, timeout=300)[0]
    assert start == 5 and len(losses) == 5
    assert max_rel(losses, ref_loss[5:]) <= TOL, f"resumed {losses} vs {ref_loss[5:]}"


def test_predict_prints_the_trained_models_top_classes(tmp_path):
    """``gridshard predict`` reads image files as training reads a folder and gives the trained
    model's softmax, best first (the same numbers as the model on the same pixels)."""
    import numpy as np
    import torch
    from PIL import Image

    from gridshard.data.images import read_image
    from gridshard.predict import predict_images

    files = []
    for k in range(2):
        pixels = np.random.default_rng(k).integers(0, 256, (12, 12), dtype=np.uint8)
        files.append(str(tmp_path / f"{k}.png"))
        Image.fromarray(pixels, "L").save(files[-1])
    images = torch.stack([read_image(f, 12, 1) for f in files])
    logits = run_on_ranks(1, _save_and_predict, str(tmp_path / "run"), images, timeout=300)[0]
    folder, step, rows = predict_images(str(tmp_path / "run"), files, top=3)
    assert step == 3 and folder.endswith("step_3")
    probs = torch.softmax(logits.double(), -1)
    for (image, best), p in zip(rows, probs):
        top = p.topk(3)
        assert [name for name, _ in best] == [str(int(i)) for i in top.indices]
        assert [q for _, q in best] == pytest.approx(top.values.tolist(), rel=1e-5)
    # `gridshard generate` on this image classifier: one line pointing to predict
    from click.testing import CliRunner

    from gridshard.cli import main

    out = CliRunner().invoke(main, ["generate", str(tmp_path / "run"), "--prompt", "a"])
    assert out.exit_code != 0
    assert "holds a Vision Transformer (model.kind=vit), an image classifier" in out.output
    assert f"Fix: `gridshard predict {folder} IMAGE...`" in out.output
