"""``gridshard.parallelize`` of gridshard's own plain Transformer (grouped-query attention,
padded vocabulary, tied and untied) against the same plain model on one device.

Each case builds the plain model on the meta device twice: once laid out whole (the
reference) and once on the mesh. It checks that the gathered canonical state_dict equals
the reference bit for bit (initialisation does not depend on the layout) and that loss,
gathered logits and every gathered parameter gradient agree. fp32 tolerance 1e-5: the
only differences are summation orders of all-reduces and split matmuls (observed ≤ 3e-7).
"""
import pytest
import torch

from gridshard.testing import run_on_ranks
from gridshard.testing.parallel_reference import compare_with_reference

TOL = 1e-5


def own_tiny(tied=False, kv_heads=2):
    from gridshard.models import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=kv_heads, ffn_hidden=96,
                      max_seq_len=16, tie_embeddings=tied, init_std=0.1)
    with torch.device("meta"):
        return Transformer(cfg)


def _own(D, T, mode, sp, tied, kv_heads, overlap=True):
    errors = compare_with_reference(lambda: own_tiny(tied, kv_heads), D, T, mode, sp, batch=4, seq=8, seed=3,
                                    overlap_input_grad=overlap)
    return {k: v for k, v in errors.items() if not k.startswith("grad:")}


CASES = {  # name: (D, T, mode, sequence_parallel, tied, kv_heads[, overlap_input_grad])
    "T2-1d-gqa": (1, 2, "1d", False, False, 2),
    "T2-1d-no-overlap": (1, 2, "1d", False, False, 2, False),    # the shared input's copy_to_group path
    "T2-1d-SP-tied": (1, 2, "1d", True, True, 2),
    "T4-1d-kv-replicated": (1, 4, "1d", False, False, 2),
    "T4-1d-SP-kv-replicated-tied": (1, 4, "1d", True, True, 2),
    "T4-2d-gqa": (1, 4, "2d", False, False, 2),
    "T4-2d-tied": (1, 4, "2d", False, True, 4),
    "D2-T2-1d": (2, 2, "1d", False, False, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parallelized_model_equals_plain_model(name):
    D, T, *rest = CASES[name]
    errors = run_on_ranks(D * T, _own, D, T, *rest)[0]
    for what in ("loss", "logits", "grad"):
        assert errors[what] <= TOL, f"{name}: {what} differs by {errors[what]:.2e}"


def _count_draws(T, mode):
    """Elements drawn from the counter RNG on this rank vs. its parameter elements."""
    import gridshard.parallel.materialize as materialize
    from gridshard import build_mesh, parallelize

    drawn = []
    real = materialize.fill_normal_

    def counting(out, *args, **kwargs):
        drawn.append(out.numel())
        return real(out, *args, **kwargs)

    materialize.fill_normal_ = counting
    try:
        model = parallelize(own_tiny(False, 4), build_mesh(1, 1, T, mode), seed=0, device="cpu")
    finally:
        materialize.fill_normal_ = real
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    return sum(drawn), matrices


@pytest.mark.parametrize("T,mode", [(4, "1d"), (4, "2d")])
def test_each_rank_draws_only_its_shard(T, mode):
    """O(shard) initialisation: a rank evaluates the generator exactly on its own blocks
    (every matrix element except vocabulary padding rows), i.e. 1/T of the model (multi-head
    here: with T > kv heads the T/kv ranks sharing a kv block each evaluate it)."""
    one = run_on_ranks(1, _count_draws, 1, "none")[0]
    per_rank = run_on_ranks(T, _count_draws, T, mode)
    total_global = one[0]
    for drawn, local_matrices in per_rank:
        assert drawn <= local_matrices                           # padding rows draw nothing
        assert drawn <= total_global / T + 97 * 64 // T + 64     # ≈ 1/T of the model's draws
    assert sum(d for d, _ in per_rank) == total_global           # every global element exactly once


def _layout_error(model_kwargs, T, mode, plan_rules=None):
    from gridshard import build_mesh, parallelize
    from gridshard.errors import LayoutError
    from gridshard.models import ModelConfig, Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**{"vocab_size": 97, "hidden": 64, "heads": 4, "ffn_hidden": 96,
                                           **model_kwargs}))
    if plan_rules == "extra":
        model.extra = torch.nn.Linear(4, 4, device="meta")
    try:
        parallelize(model, build_mesh(1, 1, T, mode), device="cpu")
    except LayoutError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kwargs,T,mode,words", [
    ({"heads": 6, "hidden": 96}, 4, "1d", ["heads=6", "whole attention heads", "Fix"]),
    ({"heads": 6, "kv_heads": 3, "hidden": 96, "ffn_hidden": 96}, 2, "1d", ["kv_heads=3", "replicated", "Fix"]),
    ({"kv_heads": 1}, 4, "2d", ["kv_heads=1", "q=2", "Fix"]),
    ({"ffn_hidden": 91}, 4, "2d", ["ffn_hidden=91", "Fix"]),
    ({}, 2, "1d", ["'extra'", "no rule", "with_rules"]),
])
def test_layouts_that_cannot_work_fail_with_one_clear_error(kwargs, T, mode, words):
    """Raised by parallelize before any layer is built or any collective issued."""
    msg = run_on_ranks(T, _layout_error, kwargs, T, mode, "extra" if "'extra'" in words else None)[0]
    assert msg is not None, f"{kwargs} on T={T} {mode}: no error"
    for w in words:
        assert w in msg, (w, msg)


def _dtensor_views(T, mode, tied):
    from gridshard import build_mesh, gathered_state_dict, parallelize
    from gridshard.testing.dtensor_views import dtensor_state_dict

    model = parallelize(own_tiny(tied, 4), build_mesh(1, 1, T, mode), seed=2, device="cpu")
    full = gathered_state_dict(model)
    views = dtensor_state_dict(model)
    checked, none = 0, []
    for name, v in views.items():
        if v is None:
            none.append(name)
            continue
        assert tuple(v.shape) == tuple(full[name].shape), name
        assert torch.equal(v.full_tensor(), full[name]), f"{name}: DTensor view differs from the canonical tensor"
        checked += 1
    return checked, none


@pytest.mark.parametrize("T,mode,tied", [(2, "1d", False), (4, "1d", True), (4, "2d", False), (4, "2d", True)])
def test_dtensor_views_are_the_canonical_tensors(T, mode, tied):
    """Every parameter whose block is a standard DTensor chunk (all but the 2D norm vectors)
    is viewed as a DTensor of the canonical shape whose full_tensor() is the canonical one."""
    checked, none = run_on_ranks(T, _dtensor_views, T, mode, tied)[0]
    assert all(n.endswith("layernorm.weight") or n == "norm.weight" for n in none), none
    # 2 layers × (7 projections + 2 norms) + embedding + final norm + head = 21 entries
    assert checked + len(none) == 21
    assert len(none) == (0 if mode == "1d" else 5)
