"""A ViT trains at 3D exactly like one process: the tiny ViT of :mod:`tests.test_vit_train` on the
bundled digits, 10 steps at (D, P, T) = (1, 1, 8), ``tensor_mode: 3d`` (q = 2), against the
single-process run: per-step loss and gradient norm within 1e-5 relative (fp32, clipping active), the
same accuracies, the validation losses and the final gathered parameters within 1e-5 (the key biases
aside, as in :mod:`tests.test_vit_2p5d`), also at ZeRO-3 with selective recompute, with two
pipeline stages (1F1B, 16 ranks) and with data parallelism at ZeRO-2 ((2, 1, 8), 16 ranks). Without ranks
(make test): the ViT config rules at 2.5D / 3D.

How: ``parallelize`` maps the ViT plan's kinds to the 3D layers (:func:`gridshard.tensor.tp3d.build.build_3d`):
``ViTEmbeddings3D``, ``LayerNorm3D`` and ``ClsClassifier3D`` on the residual orientation, the projections to
``Linear3D`` (column on the residual orientation, row on the swapped one); rank (i, j, l) reads image batch
block i·q + j of q² and its labels (the head's logits are in the same block), the loss is
``classification_loss_3d``. Wide: 8 and 16 ranks.
"""
import pytest

pytest.importorskip("sklearn")

from .test_vit_2p5d import TRAIN, check_vit_run  # noqa: E402
from .test_vit_train import CFG  # noqa: E402


@pytest.mark.wide                      # 8 ranks
@pytest.mark.parametrize("train", [{}, {"zero": 3, "recompute": "selective"}], ids=["zero0", "zero3-selective"])
def test_vit_3d_training_matches_one_process(train):
    blocks = check_vit_run({"tensor": 8, "tensor_mode": "3d"}, train)
    # rank (i, j, l) reads image batch block i·q + j of q² = 4 (twice: l = 0, 1); no replica sum
    assert sorted(blocks) == sorted((4, b, 1) for b in range(4) for _ in range(2))


def test_vit_config_at_2p5d_and_3d():
    """No ranks (make test): a ViT config is accepted at 2.5D and 3D (with pipeline stages too); at 3D
    the MLP width must fill q³ bias blocks (one ConfigError naming the field and a fix)."""
    from gridshard.config import resolve_config
    from gridshard.errors import ConfigError

    def cfg(parallel, **model):
        return {**CFG, "model": {**CFG["model"], **model}, "train": TRAIN, "parallel": parallel}

    for par in ({"tensor": 8, "tensor_mode": "2.5d", "tensor_depth": 2}, {"tensor": 8, "tensor_mode": "3d"},
                {"tensor": 8, "tensor_mode": "3d", "pipeline": 2}):
        world = 8 * par.get("pipeline", 1)
        assert resolve_config(cfg(par), world_size=world, cuda_available=False).model.kind == "vit"
    with pytest.raises(ConfigError, match=r"model.ffn_hidden.*q³=8 blocks") as err:
        resolve_config(cfg({"tensor": 8, "tensor_mode": "3d"}, ffn_hidden=36), world_size=8, cuda_available=False)
    assert "Fix:" in str(err.value)


@pytest.mark.wide                      # 16 ranks
def test_vit_3d_pipeline_stages_match_one_process():
    """(D, P, T) = (1, 2, 8) at 3D, 1F1B: embeddings + layer 0 | layer 1 + head, the boundary block
    [m/q², s, h/q]; the last stage's labels are the images' block (the head reads the residual orientation)."""
    blocks = check_vit_run({"tensor": 8, "tensor_mode": "3d", "pipeline": 2}, ranks=16)
    assert sorted(blocks) == sorted((4, b, 1) for b in range(4) for _ in range(4))


@pytest.mark.wide                      # 16 ranks
def test_vit_3d_data_parallel_zero2_matches_one_process():
    """(D, P, T) = (2, 1, 8) at 3D, ZeRO-2: each data replica's cube reads half the batch (global 8 = 2 replicas
    × one micro-batch of q² = 4 images), rank (i, j, l) its block i·q + j; the reducer sums over the D = 2 ranks
    at the same cube position."""
    blocks = check_vit_run({"data": 2, "tensor": 8, "tensor_mode": "3d"}, {"zero": 2}, ranks=16)
    assert sorted(blocks) == sorted((4, b, 2) for b in range(4) for _ in range(4))
