"""Bad 2D layouts and sizes fail with one clear error (value, rule, fix) before any collective.

Every case runs on all ranks of a 4-rank job; the ledger must be empty afterwards,
i.e. no rank issued a collective before raising.
"""
import pytest
import torch

from gridshard.comm import LEDGER
from gridshard.comm.grid_ops import split_batch
from gridshard.errors import LayoutError, ShapeError
from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer
from gridshard.nn import make_style
from gridshard.nn.classifier_2d import Classifier2D
from gridshard.nn.cross_entropy_2d import cross_entropy_2d
from gridshard.nn.embedding_2d import Embedding2D
from gridshard.nn.linear_2d import Linear2D
from gridshard.nn.norm_2d import LayerNorm2D, RMSNorm2D
from gridshard.nn.patch_embedding_2d import PatchEmbedding2D
from gridshard.nn.style_1d import Megatron1DStyle
from gridshard.nn.style_2d import Summa2DStyle
from gridshard.parallel import parallelize
from gridshard.testing import run_on_ranks


def _meta_model(**cfg):
    with torch.device("meta"):
        return Transformer(ModelConfig(vocab_size=50, layers=1, **cfg))


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match) as info:
        fn()
    msg = str(info.value)
    assert "Fix:" in msg, f"error without a fix: {msg}"
    return msg


def _errors():
    LEDGER.reset()
    # non-square T: 4 ranks as data=2 × tensor=2 cannot be a q×q grid
    msg = _raises(LayoutError, "not a perfect square", lambda: build_mesh(data=2, tensor=2, tensor_mode="2d"))
    assert "tensor=1" in msg and "tensor=4" in msg
    mesh = build_mesh(tensor=4, tensor_mode="2d")
    # layer sizes not divisible by q or q²
    _raises(ShapeError, "in_features=9 is not divisible by grid side q=2", lambda: Linear2D(9, 8, mesh))
    _raises(ShapeError, "out_features=7 is not divisible by grid side q=2", lambda: Linear2D(8, 7, mesh, bias=False))
    _raises(ShapeError, r"out_features \(bias is split into q² blocks\)=6 is not divisible by q²=4",
            lambda: Linear2D(8, 6, mesh, bias=True))
    _raises(ShapeError, "q × fused_parts=6", lambda: Linear2D(8, 9, mesh, bias=False, fused_parts=3))
    _raises(ShapeError, "divisible by q²=4", lambda: RMSNorm2D(6, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: LayerNorm2D(10, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: Embedding2D(11, 6, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: Classifier2D(6, 3, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: PatchEmbedding2D(8, 4, 3, 6, mesh))
    # wrong local block at forward time
    _raises(ShapeError, "each rank holds in/q = 4", lambda: Linear2D(8, 8, mesh)(torch.zeros(2, 3, 8)))
    _raises(ShapeError, "hidden/q = 4", lambda: RMSNorm2D(8, mesh)(torch.zeros(2, 3, 8)))
    _raises(ShapeError, "targets", lambda: cross_entropy_2d(torch.zeros(2, 3, 4), torch.zeros(2, 4).long(), mesh, 8))
    # token ids outside the vocabulary (a silent zero embedding / wrong loss otherwise)
    from gridshard.nn.embedding_2d import VocabParallelEmbedding2D
    _raises(ShapeError, "id 13 is outside the vocabulary", lambda: VocabParallelEmbedding2D(13, 8, mesh)(
        torch.full((1, 3), 13)))
    _raises(ShapeError, "id 9 is outside the vocabulary", lambda: cross_entropy_2d(
        torch.zeros(2, 3, 5), torch.full((2, 3), 9), mesh, 9))
    # batch not divisible by q
    style = Summa2DStyle(mesh)
    _raises(ShapeError, "batch=3 is not divisible by grid side q=2", lambda: style.shard_tokens(torch.zeros(3, 4)))
    _raises(ShapeError, "batch=5 is not divisible by grid side q=2", lambda: split_batch(torch.zeros(5, 3), mesh))
    # model shapes (the shared shape rules) and parallelize's layout check of a plain model
    _raises(ShapeError, "micro_batch=3", lambda: style.check_shapes(3, 8, 16, 4, 24, 50))
    _raises(ShapeError, "heads=3", lambda: style.check_shapes(2, 8, 24, 3, 24, 50))
    _raises(ShapeError, "ffn_hidden=9", lambda: style.check_shapes(2, 8, 16, 4, 9, 50))
    _raises(LayoutError, r"heads=3 on a q=2 grid: 2D splits it into q column blocks.*Fix: use a grid side q "
                         r"that divides 3",
            lambda: parallelize(_meta_model(hidden=24, heads=3, ffn_hidden=24), mesh, device="cpu"))
    _raises(LayoutError, r"kv_heads=1 on a q=2 grid",
            lambda: parallelize(_meta_model(hidden=16, heads=4, kv_heads=1, ffn_hidden=24), mesh, device="cpu"))
    _raises(LayoutError, r"ffn_hidden=9 on a q=2 grid",
            lambda: parallelize(_meta_model(hidden=16, heads=4, ffn_hidden=9), mesh, device="cpu"))
    _raises(LayoutError, r"hidden=18 on a q=2 grid: 2D norm weights are stored in q² blocks.*Fix: use hidden a "
                         r"multiple of 4",
            lambda: parallelize(_meta_model(hidden=18, heads=2, ffn_hidden=24), mesh, device="cpu"))
    _raises(LayoutError, r"sequence_parallel=True\) on tensor_mode='2d'",
            lambda: parallelize(_meta_model(hidden=16, heads=4, ffn_hidden=24), mesh, sequence_parallel=True,
                                device="cpu"))
    # a 2D style needs a 2D mesh and no sequence parallelism
    _raises(LayoutError, "tensor_mode='2d'", lambda: Summa2DStyle(build_mesh(tensor=4, tensor_mode="1d")))
    _raises(LayoutError, "sequence_parallel", lambda: make_style(mesh, sequence_parallel=True))
    assert isinstance(make_style(mesh), Summa2DStyle)
    assert LEDGER.count() == 0, f"a collective ran before an error:\n{LEDGER.summary()}"
    return True


def test_bad_2d_inputs_fail_before_any_collective():
    assert all(run_on_ranks(4, _errors))


def _style_misuse():
    LEDGER.reset()
    mesh = build_mesh(tensor=4, tensor_mode="2d")
    # a 1D style on a 2D mesh would split over the flat tensor axis and ignore the grid
    _raises(LayoutError, r"Megatron1DStyle on a 2D mesh.*Fix: build the mesh with tensor_mode='1d'",
            lambda: Megatron1DStyle(mesh))
    # the 2D loss before lm_head recorded the vocabulary size (it could not mask the padding)
    with pytest.raises(LayoutError, match=r"Summa2DStyle\.loss needs the vocabulary size.*lm_head"):
        Summa2DStyle(mesh).loss(torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long))
    assert LEDGER.count() == 0, f"a collective ran before an error:\n{LEDGER.summary()}"
    return True


def test_1d_style_on_a_2d_mesh_and_loss_before_head_fail_clearly():
    assert all(run_on_ranks(4, _style_misuse))
