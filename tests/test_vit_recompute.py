"""The ViT's encoder layers (``vit.encoder.layer.N``) are decoder-layer units
(:mod:`gridshard.parallel.decoder_layers`): ``train.recompute`` full / selective give the
``none`` run bit for bit in fp32 (losses and every gathered parameter) with fewer bytes kept for
backward, ZeRO-3 makes one unit per encoder layer, and ``train.compile`` gives the eager
losses within 1e-5 relative."""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("sklearn")

from gridshard.engine import Trainer  # noqa: E402
from gridshard.parallel import gathered_state_dict  # noqa: E402
from gridshard.parallel.decoder_layers import decoder_layers  # noqa: E402
from gridshard.testing import run_on_ranks  # noqa: E402

from .test_recompute import _saved_bytes  # noqa: E402  (images and labels go through the same path)

# 12×12 images in 4×4 patches: 10 tokens (sequence parallelism at T=2); hidden 32 = 8·q² (2D, q=2)
CFG = {"model": {"kind": "vit", "image_size": 12, "patch_size": 4, "channels": 1, "num_classes": 10, "hidden": 32,
                 "layers": 2, "heads": 4, "ffn_hidden": 64},
       "data": {"kind": "digits"},
       "train": {"global_batch": 8, "micro_batch": 4, "steps": 3, "lr": 3e-3, "warmup_steps": 1, "log_interval": 1,
                 "seed": 7, "precision": "fp32", "eval_interval": 0}}


def _cfg(D, T, mode, sp, **train):
    return {**CFG, "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp},
            "train": {**CFG["train"], **train}}


def _body(cfg):
    torch._dynamo.reset()
    trainer = Trainer(cfg, progress=False)
    saved = _saved_bytes(trainer) if not cfg["train"].get("compile") else None
    losses = trainer.run()
    units = [u.name for u in getattr(trainer.job.reducer, "units", [])]
    state = gathered_state_dict(trainer.model)
    return (losses, state, saved, units) if dist.get_rank() == 0 else None


def test_vit_layers_are_the_units():
    from gridshard.models.vit import ViTConfig, VisionTransformer

    with torch.device("meta"):
        model = VisionTransformer(ViTConfig(layers=3))
    assert [n for n, _ in decoder_layers(model)] == [f"vit.encoder.layer.{i}" for i in range(3)]


@pytest.mark.parametrize("layout", [(1, 2, "1d", True), pytest.param((1, 4, "2d", False), marks=pytest.mark.wide)],
                         ids=["T2-1d-SP", "T4-2d"])
def test_vit_recompute_is_exact_and_saves_activations(layout):
    D, T, mode, sp = layout
    runs = {r: run_on_ranks(D * T, _body, _cfg(D, T, mode, sp, recompute=r), timeout=300)[0]
            for r in ("none", "selective", "full")}
    losses, state, saved, _ = runs["none"]
    for r in ("selective", "full"):
        assert runs[r][0] == losses, r                                # bit for bit
        assert all(torch.equal(runs[r][1][k], state[k]) for k in state), r
    assert runs["full"][2] < runs["selective"][2] < saved, {r: v[2] for r, v in runs.items()}


@pytest.mark.wide
def test_vit_zero3_units_are_the_encoder_layers_and_recompute_composes():
    plain = run_on_ranks(2, _body, _cfg(2, 1, "none", False, zero=3), timeout=300)[0]
    full = run_on_ranks(2, _body, _cfg(2, 1, "none", False, zero=3, recompute="full"), timeout=300)[0]
    assert plain[3] == ["vit.encoder.layer.0", "vit.encoder.layer.1", "root"], plain[3]
    assert full[0] == plain[0] and all(torch.equal(full[1][k], v) for k, v in plain[1].items())


@pytest.mark.wide
@pytest.mark.parametrize("layout", [(1, 1, "none", False), (1, 2, "1d", True)], ids=["T1", "T2-1d-SP"])
def test_vit_compiled_layers_train_like_eager(layout):
    D, T, mode, sp = layout
    eager, compiled = (run_on_ranks(D * T, _body, _cfg(D, T, mode, sp, compile=c), timeout=600)[0]
                       for c in (False, True))
    assert len(compiled[0]) == CFG["train"]["steps"]
    for a, b in zip(eager[0], compiled[0]):
        assert abs(a - b) <= 1e-5 * abs(a), (eager[0], compiled[0])
