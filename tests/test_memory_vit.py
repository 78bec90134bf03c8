"""The memory model of the Vision Transformer (:mod:`gridshard.theory.memory.vision`) against a real laid-out ViT.

* parameter blocks: :func:`rank_parameter_blocks` of a ViT config lists exactly the local shapes
  ``gridshard.parallelize`` gives each rank (none, 1D, 1D + SP, 2D; 3D wide);
* activations: the bytes autograd saves during one forward and loss (counted by
  :class:`gridshard.engine.memory_meter.SavedTensorMeter`) equal :func:`activation_bytes` of the ViT
  config to the byte, for recompute none / selective / full, in fp32, under bf16 autocast over fp32
  parameters (``autocast``: weight copies) and with bf16 parameters (``bf16``: ``train.precision: bf16``),
  with one and two encoder layers (so the per-layer term is checked apart from the ends).
"""
import pytest
import torch

from gridshard.models.vit import ViTConfig
from gridshard.parallel.rank_blocks import rank_parameter_blocks
from gridshard.testing import run_on_ranks
from gridshard.theory import memory as M

BATCH = 8
PRECISIONS = {"fp32": ("fp32", 4), "autocast": ("bf16", 4), "bf16": ("bf16", 2)}   # name: (precision, param bytes)
RECOMPUTE = ("none", "selective", "full")
LAYOUTS = {  # name: (T, mode, sequence_parallel, image_size); 12-pixel images give 10 tokens (SP splits them)
    "T1-none": (1, "none", False, 16),
    "T2-1d": (2, "1d", False, 16),
    "T2-1d-SP": (2, "1d", True, 12),
    "T4-2d": (4, "2d", False, 16),
    "T8-3d": (8, "3d", False, 16),
}
WIDE = {"T8-3d"}


def vit_config(image_size: int, layers: int) -> ViTConfig:
    return ViTConfig(image_size=image_size, patch_size=4, channels=1, num_classes=10, hidden=32, layers=layers,
                     heads=4, ffn_hidden=64)


def _measure(T, mode, sp, image_size):
    """On each rank: its parameter (name, shape) list and the saved-for-backward bytes of one forward
    and loss per (layers, precision, recompute)."""
    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models.vit import VisionTransformer
    from gridshard.parallel.recompute import apply_recompute

    g = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 1, image_size, image_size, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    out = {"saved": {}}
    for layers in (1, 2):
        for name, (precision, pb) in PRECISIONS.items():
            for recompute in RECOMPUTE:
                with torch.device("meta"):
                    plain = VisionTransformer(vit_config(image_size, layers))
                model = parallelize(plain, build_mesh(1, 1, T, mode), sequence_parallel=sp, seed=0, device="cpu")
                if pb == 2:
                    model.to(torch.bfloat16)
                apply_recompute(model, recompute)
                ctx = model.parallel_context
                autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
                with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
                    ctx.model_loss(model, ctx.shard_tokens(images), ctx.shard_targets(labels), reduction="sum")
                out["saved"][layers, name, recompute] = meter.bytes
        out["params", layers] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return out


_RESULTS: dict = {}


def measured(name):
    if name not in _RESULTS:
        T, mode, sp, image = LAYOUTS[name]
        _RESULTS[name] = run_on_ranks(T, _measure, T, mode, sp, image)
    return _RESULTS[name]


def _layouts():
    return [pytest.param(n, marks=pytest.mark.wide) if n in WIDE else n for n in LAYOUTS]


@pytest.mark.parametrize("name", _layouts())
def test_vit_parameter_blocks_are_the_laid_out_shapes(name):
    T, mode, sp, image = LAYOUTS[name]
    for layers in (1, 2):
        expected = sorted(_hf_names(b.name, b.shape) for b in rank_parameter_blocks(vit_config(image, layers), mode, T))
        for rank, got in enumerate(measured(name)):
            assert sorted(got["params", layers]) == expected, f"{name} rank {rank} layers {layers}"


def _hf_names(name, shape):
    """A block's name as the model calls it (``rank_blocks`` names a layer's blocks ``layers.<i>.``)."""
    return (name.replace("layers.", "vit.encoder.layer.", 1) if name.startswith("layers.") else name), shape


@pytest.mark.parametrize("name", _layouts())
def test_vit_saved_activation_bytes_equal_the_formula(name):
    T, mode, sp, image = LAYOUTS[name]
    wrong = []
    for layers in (1, 2):
        for precision_name, (precision, pb) in PRECISIONS.items():
            for recompute in RECOMPUTE:
                formula = M.activation_bytes(vit_config(image, layers), BATCH, 0, mode, T, sp, recompute,
                                             precision=precision, param_bytes=pb).total
                for rank, got in enumerate(measured(name)):
                    have = got["saved"][layers, precision_name, recompute]
                    if have != formula:
                        wrong.append(f"layers={layers} {precision_name} {recompute} rank {rank}: measured {have} B, "
                                     f"formula {formula} B")
    assert not wrong, f"{name}:\n" + "\n".join(wrong)


def test_vit_layer_terms_by_hand():
    """One layer of h = 32, f = 64, 4 heads, b = 8 images of 17 tokens (N = 136), fp32, no tensor
    parallelism: 2 LayerNorms of x, y (N·h·4 each) and mean, rstd (N·4 each); q, k, v, the attention
    output (N·h·4 each); the log-sum-exp N·H·4; u, gelu(u) (N·f·4 each)."""
    cfg, N, h, f = vit_config(16, 1), 8 * 17, 32, 64
    layer = M.vit_layer_saved_tensors(cfg, "none", 1, False, N)
    assert sum(layer.values()) == 2 * (2 * N * h * 4 + 2 * N * 4) + 4 * N * h * 4 + N * 4 * 4 + 2 * N * f * 4
    assert sum(M.vit_layer_saved_tensors(cfg, "none", 1, False, N, "selective").values()) \
        == sum(layer.values()) - N * 4 * 4
    assert M.vit_layer_saved_tensors(cfg, "2d", 4, False, N, "full") == {"input": N * h // 4 * 4}


def test_check_and_plan_price_a_vit_config():
    """``gridshard train --check`` prints the ViT's predicted peak (its parts from the ViT's model), and
    ``gridshard plan`` ranks ViT layouts (none, 1D, 2D on 4 ranks; no sequence parallelism: 17 tokens)."""
    from gridshard.config import load_config
    from gridshard.planner import fit
    from gridshard.planner.search import plan

    cfg = load_config("configs/vit_digits.yaml")
    budget = fit.MemoryBudget(int(0.9 * 23e9 / 4), int(23e9), "23 GB host RAM shared by 4 local processes", local=4)
    line = fit.check_memory(cfg, 4, budget)
    mem, _ = fit.predicted_peak(cfg, budget)
    acts = M.activation_bytes(cfg.model.resolve(), 30, 17, "1d", 2)
    assert line.startswith("predicted peak memory per rank: ") and mem.activations == acts.total + 30 * 10 * 8
    modes = {(c.layout.tensor_mode, c.layout.tensor, c.layout.sequence_parallel) for c in plan(cfg, 4).candidates}
    assert {("none", 1, False), ("1d", 2, False), ("1d", 4, False), ("2d", 4, False)} <= modes
    assert not any(sp for _, _, sp in modes)


def _trained_metrics(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.run()
    return trainer.history[-1]


def test_the_trainer_predicts_a_vit_run_s_peak(tmp_path):
    """A 1D (T = 2) ViT on the digits in fresh processes: ``predicted_mem_bytes`` (the resident set
    before the model, what loading the digits added, the ViT's model state and activations) within
    15 % of each rank's peak resident set; the model is small, so this checks the baseline's parts."""
    pytest.importorskip("sklearn")
    cfg = {"parallel": {"data": 1, "tensor": 2, "tensor_mode": "1d"},
           "model": {"kind": "vit", "image_size": 16, "patch_size": 4, "channels": 1, "num_classes": 10, "hidden": 64,
                     "layers": 2, "heads": 4, "ffn_hidden": 128},
           "data": {"kind": "digits"},
           "train": {"global_batch": 32, "micro_batch": 16, "steps": 3, "log_interval": 3, "eval_interval": 0}}
    rec = run_on_ranks(2, _trained_metrics, cfg, str(tmp_path), fresh=True)[0]
    for peak, predicted in zip(rec["peak_mem_bytes_per_rank"], rec["predicted_mem_bytes_per_rank"]):
        assert 0.85 < predicted / peak < 1.15, (peak, predicted)
