"""Bad input to the 1D layers fails with one clear error, raised before any collective.

Every case runs on all ranks of the tensor group; each rank must raise the
expected error (message naming the value and the rule) with an empty ledger, so
no rank can be left waiting in a collective (the harness timeout would turn such a
hang into a failure with stacks).
"""
import pytest
import torch

from gridshard.comm import LEDGER
from gridshard.errors import LayoutError, ShapeError
from gridshard.models import ModelConfig, Transformer
from gridshard.tensor.tp1d.cross_entropy import vocab_parallel_cross_entropy
from gridshard.tensor.tp1d.embedding import VocabParallelEmbedding, padded_vocab_size
from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear
from gridshard.nn.norm import RMSNorm
from gridshard.nn.shape_rules import model_shape_rules
from gridshard.parallel import parallelize
from gridshard.testing import run_on_ranks

from .test_tp1d_helpers import check_model_shapes, mesh_1d


def _meta_model(**cfg):
    with torch.device("meta"):
        return Transformer(ModelConfig(vocab_size=37, layers=1, **cfg))


def _raises(exc, match, fn):
    """``fn()`` raises ``exc`` matching ``match`` and issued no collective before raising."""
    LEDGER.reset()
    with pytest.raises(exc, match=match):
        fn()
    assert LEDGER.count() == 0, f"a collective ran before the error: {LEDGER.summary()}"


def _errors(T):
    mesh = mesh_1d(T)
    x = lambda *shape: torch.randn(*shape)

    # construction: sizes that do not split over T
    _raises(ShapeError, rf"out_features={2 * T + 1} is not divisible by tensor-parallel size T={T}",
            lambda: ColumnParallelLinear(8, 2 * T + 1, mesh))
    _raises(ShapeError, rf"in_features={2 * T + 1} is not divisible by tensor-parallel size T={T}",
            lambda: RowParallelLinear(2 * T + 1, 8, mesh))
    _raises(LayoutError, r"input_is_parallel=True",
            lambda: RowParallelLinear(4 * T, 8, mesh, input_is_parallel=False, sequence_parallel=True))
    _raises(LayoutError, r"needs the mesh", lambda: RMSNorm(8, sequence_parallel=True))

    # forward: the misuse is detected before the layer's collective
    row = RowParallelLinear(4 * T, 8, mesh)
    _raises(ShapeError, r"FULL in_features.*gather_output=True", lambda: row(x(2, 3, 4 * T)))
    _raises(ShapeError, r"last dim 5, expected 4", lambda: row(x(2, 3, 5)))
    col = ColumnParallelLinear(8, 4 * T, mesh, gather_output=True)
    _raises(ShapeError, r"last dim 7, expected 8", lambda: col(x(2, 3, 7)))
    # the chained misuse: only the column's gather ran, the row refused before its all-reduce
    LEDGER.reset()
    with pytest.raises(ShapeError, match="gather_output=True"):
        row(col(x(2, 3, 8)))
    assert LEDGER.count("all_reduce") == 0 and LEDGER.count("all_gather") == LEDGER.count() == 1

    row_sp = RowParallelLinear(4 * T, 8, mesh, sequence_parallel=True)
    _raises(ShapeError, rf"sequence length s={2 * T + 1} is not divisible by tensor-parallel size T={T}",
            lambda: row_sp(x(2, 2 * T + 1, 4)))
    col_sp = ColumnParallelLinear(8, 4 * T, mesh, sequence_parallel=True)
    _raises(ShapeError, r"3-D activation", lambda: col_sp(x(6, 8)))

    emb = VocabParallelEmbedding(37, 8, mesh, sequence_parallel=True)
    _raises(ShapeError, r"id 37 is outside the vocabulary \[0, 37\)", lambda: emb(torch.tensor([[1, 37] * T])))
    _raises(ShapeError, r"id -1 is outside", lambda: emb(torch.tensor([[-1, 3] * T])))
    _raises(ShapeError, r"integer tensor", lambda: emb(torch.zeros(2, 2 * T)))
    _raises(ShapeError, rf"sequence length s={2 * T + 1} is not divisible",
            lambda: emb(torch.zeros(2, 2 * T + 1, dtype=torch.long)))

    logits = x(2, 4, padded_vocab_size(37, T) // T)
    _raises(ShapeError, r"id 37 is outside the vocabulary \[0, 37\)",
            lambda: vocab_parallel_cross_entropy(logits, torch.full((2, 4), 37), mesh, vocab_size=37))
    _raises(ShapeError, r"disagree", lambda: vocab_parallel_cross_entropy(logits, torch.zeros(2, 5).long(), mesh))
    _raises(ShapeError, r"vocab_size=20 does not fit",
            lambda: vocab_parallel_cross_entropy(logits, torch.zeros(2, 4).long(), mesh, vocab_size=20))

    # the shared shape rules (1D + SP) and parallelize's layout check of a plain model
    check_sp = lambda **kw: check_model_shapes("1d", T, True, **kw)     # noqa: E731
    ok = dict(batch=2, seq=4 * T, hidden=8 * T, heads=T, ffn=4 * T)
    check_sp(**ok)
    _raises(ShapeError, r"head_dim=3 is not divisible by 2\b.*rotary embeddings rotate channel pairs",
            lambda: check_sp(**{**ok, "hidden": 3 * T}))
    _raises(ShapeError, "head_dim=3 is not divisible by 2",
            lambda: check_model_shapes("none", 1, False, 2, 8, 12, 4, 16))
    if T > 1:
        # hidden % T is implied by heads % T and hidden % heads, so check_model_shapes reports an
        # earlier rule first; the rule itself is in the list the config validator reports
        bad = [r for r in model_shape_rules("1d", T, True, **{**ok, "hidden": T + 1, "heads": 1}) if not r.holds]
        assert any(r.message().startswith(f"hidden={T + 1} is not divisible by tensor={T}: ") for r in bad), \
            [r.message() for r in bad]
        _raises(ShapeError, rf"heads={T + 1} is not divisible by tensor={T}: 1D gives every "
                            rf"rank whole attention heads",
                lambda: check_sp(**{**ok, "hidden": 8 * (T + 1), "heads": T + 1}))
        _raises(ShapeError, rf"ffn_hidden={4 * T + 1} is not divisible by tensor={T}",
                lambda: check_sp(**{**ok, "ffn": 4 * T + 1}))
        _raises(ShapeError, rf"seq_len={4 * T + 1} is not divisible by tensor={T}: sequence parallelism",
                lambda: check_sp(**{**ok, "seq": 4 * T + 1}))
        check_model_shapes("1d", T, False, **{**ok, "seq": 4 * T + 1})     # without SP any length is fine
        _raises(LayoutError, rf"heads={T + 1} on T={T}: 1D gives every rank whole attention heads.*Fix: use a "
                             rf"tensor size that divides {T + 1}",
                lambda: parallelize(_meta_model(hidden=8 * (T + 1), heads=T + 1, ffn_hidden=4 * T), mesh,
                                    sequence_parallel=True, device="cpu"))
        _raises(LayoutError, rf"ffn_hidden={4 * T + 1} on T={T}: 1D gives every rank whole MLP neurons.*Fix:",
                lambda: parallelize(_meta_model(hidden=8 * T, heads=T, ffn_hidden=4 * T + 1), mesh, device="cpu"))
        # kv heads neither split by T nor a divisor of T (T=2: 3 kv heads, T=4: 6)
        kv = 3 * T // 2
        _raises(LayoutError, rf"kv_heads={kv} on T={T}: kv heads are split over T.*Fix: use a tensor size that "
                             rf"divides or is a multiple of {kv}",
                lambda: parallelize(_meta_model(hidden=4 * 3 * T, heads=3 * T, kv_heads=kv, ffn_hidden=4 * T), mesh,
                                    device="cpu"))
    _raises(ShapeError, r"hidden=10 is not divisible by heads=4",
            lambda: check_sp(**{**ok, "hidden": 10, "heads": 4}))
    return True


@pytest.mark.parametrize("T", [2, 4])
def test_bad_input_raises_before_any_collective(T):
    assert all(run_on_ranks(T, _errors, T, timeout=60))
