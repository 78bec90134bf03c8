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


def _own(D, T, mode, sp, tied, kv_heads):
    errors = compare_with_reference(lambda: own_tiny(tied, kv_heads), D, T, mode, sp, batch=4, seq=8, seed=3)
    return {k: v for k, v in errors.items() if not k.startswith("grad:")}


CASES = {  # name: (D, T, mode, sequence_parallel, tied, kv_heads)
    "T2-1d-gqa": (1, 2, "1d", False, False, 2),
    "T2-1d-SP-tied": (1, 2, "1d", True, True, 2),
    "T4-1d-kv-replicated": (1, 4, "1d", False, False, 2),
    "T4-1d-SP-kv-replicated-tied": (1, 4, "1d", True, True, 2),
    "T4-2d-gqa": (1, 4, "2d", False, False, 2),
    "T4-2d-tied": (1, 4, "2d", False, True, 4),
    "D2-T2-1d": (2, 2, "1d", False, False, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parallelized_model_equals_plain_model(name):
    D, T, mode, sp, tied, kv = CASES[name]
    errors = run_on_ranks(D * T, _own, D, T, mode, sp, tied, kv)[0]
    for what in ("loss", "logits", "grad"):
        assert errors[what] <= TOL, f"{name}: {what} differs by {errors[what]:.2e}"
