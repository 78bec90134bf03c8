"""The ViT (issue 26): the plain model against Hugging Face's ViTForImageClassification, and the
model laid out by ``parallelize`` in none / 1D / 1D+SP / 2D against the plain one, forward and
backward, on the same global weights (wide: ``make test-all``) (every layer the ViT adds — the replicated patch embedding,
LayerNorm, Classifier1D, ViTEmbeddings2D, LayerNorm2D, ClsClassifier2D — is in the comparison:
each parameter's gathered gradient is checked by name)."""
import json
import os

import pytest
import torch

from gridshard.errors import ConfigError
from gridshard.models.vit import ViTConfig, VisionTransformer
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error

# s = 1 + (12/4)² = 10 tokens: divisible by T=2 (sequence parallelism); hidden 32 = 8·q² (2D, q=2)
TINY = dict(image_size=12, patch_size=4, channels=3, num_classes=5, hidden=32, layers=2, heads=4, ffn_hidden=64)
TOL = 1e-5
# the key bias's gradient is exactly zero in exact arithmetic (softmax over keys ignores the same
# q·b added to every score), so its relative error is noise over noise: errors are measured against
# max(‖reference‖, GRAD_FLOOR) (other gradients here are ~1e-2 and above)
GRAD_FLOOR = 1e-3


def _grad_error(got, ref):
    return float((got.double() - ref.double()).norm() / max(float(ref.double().norm()), GRAD_FLOOR))


def _factory():
    with torch.device("meta"):
        return VisionTransformer(ViTConfig(**TINY))


def _images(b, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, TINY["channels"], TINY["image_size"], TINY["image_size"], generator=g), \
        torch.randint(0, TINY["num_classes"], (b,), generator=g)


def _layout_body(data, tensor, mode, sp, seed):
    """Errors (relative) of the laid-out model's initial weights, logits, loss and every gathered
    parameter gradient against the plain model on this rank (mode none, whole)."""
    from gridshard import gathered_state_dict
    from gridshard.mesh import build_mesh
    from gridshard.parallel import context_of, gather_canonical, parallelize

    world = torch.distributed.get_world_size()
    ref = parallelize(_factory(), build_mesh(world, 1, 1, "none"), seed=seed, device="cpu")
    mesh = build_mesh(data, 1, tensor, mode)
    par = parallelize(_factory(), mesh, sequence_parallel=sp, seed=seed, device="cpu")
    ctx = context_of(par)
    state, ref_state = gathered_state_dict(par), ref.state_dict()
    assert list(state) == list(ref_state)
    init_err = max(relative_error(state[k], v) for k, v in ref_state.items())
    images, labels = _images(4, seed + 1)
    ref_logits = ref(images)
    ref_loss = context_of(ref).loss(ref_logits, labels)
    ref_loss.backward()
    logits = ctx.logits(par, ctx.shard_tokens(images))
    loss = ctx.loss(logits, ctx.shard_tokens(labels))
    loss.backward()
    errors = {"init": init_err, "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
              "logits": relative_error(logits, ctx.shard_tokens(ref_logits))}
    for name, p in par.named_parameters():
        errors[f"grad:{name}"] = _grad_error(gather_canonical(p.grad, ctx.layouts[name], mesh),
                                             ref.get_parameter(name).grad)
    return errors


def _check_layout(data, tensor, mode, sp):
    seed = int.from_bytes(os.urandom(2), "little")
    for rank, errors in enumerate(run_on_ranks(data * tensor, _layout_body, data, tensor, mode, sp, seed)):
        assert errors["init"] == 0.0, f"rank {rank}: the laid-out initial weights differ from the plain model's"
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"({data},{tensor},{mode},sp={sp}) seed {seed} rank {rank}: {bad}"


# wide: make test runs the same layers through 10 training steps at 2D (tests/test_vit_train.py)
@pytest.mark.wide
@pytest.mark.parametrize("layout", [(4, 1, "none", False), (1, 4, "1d", False), (2, 2, "1d", True),
                                    (1, 2, "1d", True), (1, 4, "2d", False)])
def test_vit_layout_matches_one_process(layout):
    _check_layout(*layout)


def test_parameter_count_and_names_are_hugging_face_vits():
    model = VisionTransformer(ViTConfig(**TINY))
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_parameters()
    names = set(model.state_dict())
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings",
            "vit.embeddings.patch_embeddings.projection.weight", "vit.encoder.layer.1.attention.attention.query.bias",
            "vit.encoder.layer.0.attention.output.dense.weight", "vit.encoder.layer.0.intermediate.dense.weight",
            "vit.encoder.layer.0.output.dense.bias", "vit.encoder.layer.0.layernorm_before.bias",
            "vit.layernorm.weight", "classifier.weight", "classifier.bias"} <= names


def test_same_logits_as_hugging_face(tmp_path):
    """The plain model's state dict, saved as a Hugging Face checkpoint with the ``config.json``
    ``gridshard export`` writes, loads in ``ViTForImageClassification.from_pretrained`` and gives
    the same logits."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from transformers import ViTForImageClassification

    from gridshard.models.vit import hf_vit_config_fields

    torch.manual_seed(3)
    model = VisionTransformer(ViTConfig(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    (tmp_path / "config.json").write_text(json.dumps(hf_vit_config_fields(model.cfg)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    hf = ViTForImageClassification.from_pretrained(tmp_path).eval()
    images, _ = _images(3, 5)
    with torch.no_grad():
        assert relative_error(model(images), hf(pixel_values=images).logits) <= TOL


def test_image_size_must_be_a_multiple_of_the_patch():
    with pytest.raises(ConfigError, match="image_size=10 is not divisible by model.patch_size=4"):
        ViTConfig(image_size=10, patch_size=4)


VIT_CFG = {"model": {"kind": "vit", **TINY}, "data": {"kind": "digits"},
           "train": {"global_batch": 8, "micro_batch": 2}}


def _resolve(world=1, **sections):
    from gridshard.config import resolve_config

    cfg = {k: {**VIT_CFG.get(k, {}), **sections.get(k, {})} for k in {*VIT_CFG, *sections}}
    return resolve_config(cfg, world_size=world)


def test_vit_config_resolves_and_round_trips():
    from gridshard.config import load_config

    cfg = _resolve()
    assert cfg.data.seq_len == 1 + (TINY["image_size"] // TINY["patch_size"]) ** 2
    assert cfg.model.resolve() == ViTConfig(**TINY)
    assert load_config(cfg.resolved()).resolved() == cfg.resolved()


def test_vit_without_a_config_file_uses_the_vit_defaults():
    """`gridshard train model.kind=vit data.kind=digits` (no CONFIG): the default run's decoder preset
    and sequence length are the schema's defaults, not written values, so a ViT drops them (issue 39)."""
    from gridshard.config import load_config, validate_config

    vit = load_config(None, ["model.kind=vit", "data.kind=digits"])
    validate_config(vit, vit.world_size, False, check_data=False)
    assert vit.model.preset is None and vit.model.resolve() == ViTConfig()
    assert vit.data.seq_len == ViTConfig().seq_len
    llama = load_config(None)
    assert llama.model.preset == "tiny" and llama.data.seq_len == 128 and llama.data.kind == "stdlib"


@pytest.mark.parametrize("sections, world, message", [
    ({"model": {"preset": "tiny"}}, 1, "model.preset='tiny' is invalid with model.kind=vit"),
    ({"model": {"vocab_size": 256}}, 1, "model.vocab_size is not a Vision Transformer field"),
    ({"data": {"seq_len": 64}}, 1, "data.seq_len=64 is invalid with model.kind=vit: a ViT reads 1 + "),
    ({"data": {"kind": "stdlib"}}, 1, "data.kind='stdlib' is invalid: model.kind=vit learns from labelled images"),
    ({"model": {"image_size": 16}, "parallel": {"tensor": 2, "tensor_mode": "1d", "sequence_parallel": True}}, 2,
     "splits the ViT's 1 + (image_size/patch_size)² = 17 tokens into tensor=2 blocks"),
    ({"model": {"ffn_hidden": 66}, "parallel": {"tensor": 4, "tensor_mode": "2d"}}, 4,
     "model.ffn_hidden=66 is invalid: in 2D the MLP's first bias is stored in q²=4 blocks"),
    ({"data": {"kind": "images"}}, 1, "data.path=None is invalid: data.kind=images needs a folder"),
])
def test_vit_config_errors_name_the_field_and_the_fix(sections, world, message):
    with pytest.raises(ConfigError, match="Fix: ") as err:
        _resolve(world, **sections)
    assert message in str(err.value)


def test_llama_config_refuses_vit_fields_and_image_data():
    from gridshard.config import resolve_config

    with pytest.raises(ConfigError, match="model.image_size is a Vision Transformer field but model.kind=llama"):
        resolve_config({"model": {"image_size": 16}}, world_size=1)
    with pytest.raises(ConfigError, match="labelled images train a Vision Transformer. Fix: set model.kind: vit"):
        resolve_config({"data": {"kind": "digits"}}, world_size=1)


def _write_folder(root, sizes):
    from PIL import Image

    for cls, (w, h) in sizes.items():
        os.makedirs(root / cls, exist_ok=True)
        for k in range(3):
            Image.new("RGB", (w, h), color=(40 * k, 100, 200)).save(root / cls / f"{k}.png")


def load_image_folder(path, image_size, channels):
    """(images [n, C, S, S], labels [n], class names) of a class-per-subfolder folder, every file read."""
    from gridshard.data.images import FolderImages, folder_index

    files, labels, classes = folder_index(path)
    return FolderImages(files, image_size, channels)[torch.arange(len(files))], labels, classes


def test_image_folder_is_read_resized_and_labelled_by_class(tmp_path):
    _write_folder(tmp_path, {"cat": (20, 10), "dog": (7, 9)})          # mixed sizes: each is resized
    images, labels, classes = load_image_folder(str(tmp_path), 12, 3)
    assert classes == ["cat", "dog"] and labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert tuple(images.shape) == (6, 3, 12, 12) and -1.0 <= float(images.min()) <= float(images.max()) <= 1.0


def test_image_folder_problems_are_one_clear_message(tmp_path):
    _write_folder(tmp_path, {"cat": (8, 8)})
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="class folder 'empty' holds no image"):
        _resolve(data={"kind": "images", "path": str(tmp_path)}, model={"channels": 3})
    os.rmdir(tmp_path / "empty")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")                 # named before launch
    with pytest.raises(ConfigError, match=r"notes.txt' is not an image file .*Fix: remove it"):
        _resolve(data={"kind": "images", "path": str(tmp_path)}, model={"channels": 3})
    os.remove(tmp_path / "cat" / "notes.txt")
    (tmp_path / "cat" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(ConfigError, match="broken.png' is not a readable image"):
        _resolve(data={"kind": "images", "path": str(tmp_path)}, model={"channels": 3})
    with pytest.raises(ConfigError, match="broken.png' is not a readable image"):
        load_image_folder(str(tmp_path), 12, 3)
    png = (tmp_path / "cat" / "0.png").read_bytes()                                # a truncated PNG too
    (tmp_path / "cat" / "broken.png").write_bytes(png[:len(png) // 2])
    with pytest.raises(ConfigError, match="broken.png' is not a readable image"):
        _resolve(data={"kind": "images", "path": str(tmp_path)}, model={"channels": 3})


def test_each_data_rank_reads_only_its_share_of_an_image_folder(tmp_path):
    """Data rank d of D decodes, per step, exactly the files of its G/D rows; the ranks' files
    are disjoint and together the global batch, the same images the whole-set plan gives."""
    from gridshard.data.images import folder_index, image_plans

    _write_folder(tmp_path, {"a": (8, 8), "b": (9, 7), "c": (5, 5)})              # 9 images
    cfg = _resolve(2, data={"kind": "images", "path": str(tmp_path), "val_fraction": 0.25},
                   model={"channels": 3, "num_classes": 3}, parallel={"data": 2},
                   train={"global_batch": 4, "micro_batch": 2})
    plans = [image_plans(cfg, 2, d)[0] for d in range(2)]
    whole, labels, _ = load_image_folder(str(tmp_path), TINY["image_size"], 3)
    index = folder_index(str(tmp_path))[0]
    files = []
    for plan in plans:
        (x, y), = plan.step_batches(0)[0]
        assert plan.images.reads == 2 and len(plan.images) == 6        # 9 − ⌈0.25·9⌉ = 6 training images
        mine = [index.index(plan.images.files[i]) for i in plan.global_indices(0)[plan.rows]]
        assert torch.equal(x, whole[mine]) and y.tolist() == labels[mine].tolist()
        files += mine
    assert len(set(files)) == 4                                     # disjoint: the 4 images of the global batch


def test_plot_draws_accuracy_only_for_a_classifier(tmp_path):
    import json

    from gridshard.plot import plot_run

    rec = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "peak_mem_bytes": 1}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(rec) + "\n")
    assert not any(p.endswith("accuracy.png") for p in plot_run(str(tmp_path)))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**rec, "step": 2, "val_loss": 1.9, "accuracy": 0.5, "val_accuracy": 0.4}) + "\n")
    assert os.path.isfile([p for p in plot_run(str(tmp_path)) if p.endswith("accuracy.png")][0])


def test_vit_flops_per_token_counts_what_the_model_computes():
    """MFU's FLOPs for a ViT (theory.training.vit_flops_per_token, what the trainer reports) equal
    torch's own count of one forward + backward (matmuls, the patch convolution, attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from gridshard.theory.training import model_flops_per_token
    from gridshard.models.vit import VisionTransformer, vit_config

    mc = vit_config({"image_size": 16, "patch_size": 4, "channels": 3, "num_classes": 5, "hidden": 32,
                     "layers": 2, "heads": 4, "ffn_hidden": 48})
    model, b = VisionTransformer(mc), 3
    images = torch.randn(b, 3, 16, 16)
    # the math attention kernel is made of matmuls the counter sees (CPU's flash kernel has no FLOP rule)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(images).sum().backward()
    per_token = model_flops_per_token("vit", mc, mc.seq_len)
    assert counter.get_total_flops() == pytest.approx(per_token * b * mc.seq_len, rel=1e-9)
