"""Bad 2D layouts and sizes fail with one clear error (value, rule, fix) before any collective.
(Bad ids in the data are agreed over the grid first: ``tests/test_bad_ids_2d.py``.)

Every case runs on all ranks of a 4-rank job; the ledger must be empty afterwards,
i.e. no rank issued a collective before raising.
"""
import pytest
import torch
from torch import nn

from gridshard.comm import LEDGER
from gridshard.comm.grid_ops import split_batch
from gridshard.errors import LayoutError, ShapeError
from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer
from gridshard.tensor.tp2d.classifier import Classifier2D
from gridshard.tensor.tp2d.cross_entropy import cross_entropy_2d
from gridshard.tensor.tp2d.embedding import Embedding2D
from gridshard.tensor.tp2d.linear import Linear2D
from gridshard.tensor.tp2d.norm import LayerNorm2D, RMSNorm2D
from gridshard.tensor.tp2d.patch_embedding import PatchEmbedding2D
from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear
from gridshard.parallel import ParallelContext, check_layout, model_dims, parallelize
from gridshard.testing import run_on_ranks

from .test_tp1d_helpers import check_model_shapes


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
    _raises(ShapeError, "divisible by q²=4", lambda: RMSNorm2D(6, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: LayerNorm2D(10, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: Embedding2D(11, 6, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: Classifier2D(6, 3, mesh))
    _raises(ShapeError, "divisible by q²=4", lambda: PatchEmbedding2D(8, 4, 3, 6, mesh))
    # wrong local block at forward time
    _raises(ShapeError, "each rank holds in/q = 4", lambda: Linear2D(8, 8, mesh)(torch.zeros(2, 3, 8)))
    _raises(ShapeError, "hidden/q = 4", lambda: RMSNorm2D(8, mesh)(torch.zeros(2, 3, 8)))
    _raises(ShapeError, "targets", lambda: cross_entropy_2d(torch.zeros(2, 3, 4), torch.zeros(2, 4).long(), mesh, 8))
    # token ids outside the vocabulary depend on the data of each batch block, so they are agreed
    # over the grid by one collective before every rank raises: tests/test_bad_ids_2d.py
    # batch not divisible by q
    ctx = ParallelContext(mesh, "2d", False, 50)
    _raises(ShapeError, "batch=3 is not divisible by grid side q=2", lambda: ctx.shard_tokens(torch.zeros(3, 4)))
    _raises(ShapeError, "batch=5 is not divisible by grid side q=2", lambda: split_batch(torch.zeros(5, 3), mesh))
    # model shapes (the shared shape rules) and parallelize's layout check of a plain model
    check_2d = lambda *shape: check_model_shapes("2d", 4, False, *shape)     # noqa: E731
    check_2d(2, 8, 16, 4, 24)
    _raises(ShapeError, "micro_batch=3 is not divisible by q=2", lambda: check_2d(3, 8, 16, 4, 24))
    _raises(ShapeError, "heads=3 is not divisible by q=2", lambda: check_2d(2, 8, 24, 3, 24))
    _raises(ShapeError, "ffn_hidden=9 is not divisible by q=2", lambda: check_2d(2, 8, 16, 4, 9))
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
    # no sequence parallelism outside 1D (the layout check itself, on the plain model's dimensions)
    dims = model_dims(_meta_model(hidden=16, heads=4, ffn_hidden=24))
    _raises(LayoutError, r"sequence_parallel=True\) on tensor_mode='2d'.*Fix: use a 1d mesh",
            lambda: check_layout(dims, mesh, sequence_parallel=True))
    check_layout(dims, mesh, sequence_parallel=False)
    assert LEDGER.count() == 0, f"a collective ran before an error:\n{LEDGER.summary()}"
    return True


def test_bad_2d_inputs_fail_before_any_collective():
    assert all(run_on_ranks(4, _errors))


def _mode_follows_the_mesh():
    LEDGER.reset()
    mesh = build_mesh(tensor=4, tensor_mode="2d")
    # a 2D mesh gets the SUMMA layers: 1D layers would split over the flat tensor axis and ignore the grid
    model = parallelize(_meta_model(hidden=16, heads=4, ffn_hidden=24), mesh, device="cpu")
    ctx = model.parallel_context
    assert (ctx.mode, ctx.sequence_parallel, ctx.vocab_size) == ("2d", False, 50)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))]
    assert layers == [], f"plain or 1D linear layers on a 2D mesh: {layers}"
    projections = [f"layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert all(type(model.get_submodule(p)) is Linear2D for p in projections)
    # the 2D loss masks padding with the context's vocabulary size: logits narrower than V/q are refused
    _raises(ShapeError, r"vocab block 4 × q=2 < vocab_size=50",
            lambda: ctx.loss(torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long)))
    assert LEDGER.count() == 0, f"a collective ran before an error:\n{LEDGER.summary()}"
    return True


def test_2d_mesh_gets_2d_layers_and_the_loss_checks_its_vocabulary():
    assert all(run_on_ranks(4, _mode_follows_the_mesh))
