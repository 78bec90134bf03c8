"""Shared helpers of the 1D tensor-parallel tests (no tests here).

The reference is always a plain single-process module built from the same seed;
a parallel rank's tensor is compared with its block of the reference tensor
(:func:`expected_shard`), the reference padded with zeros when the parallel
parameter carries vocabulary padding.
"""
import torch.nn.functional as F

from gridshard.errors import ShapeError
from gridshard.mesh import build_mesh
from gridshard.nn.shape_rules import model_shape_rules
from gridshard.nn.sharding import ShardSpec, get_spec, shard_from_global
from gridshard.testing import assert_close
from gridshard.testing.inputs import randint, randn  # noqa: F401  (re-exported to the test modules)

# fp32 relative Frobenius error: a sharded layer sums its dot products in another order
# (T partial sums then an all-reduce) than the single-device reference, ~1e-7 relative
# per element for these sizes; 1e-5 leaves 100× headroom and still catches any wrong
# block, missing term or double count (errors of order 1e-1 … 1)
TOL = 1e-5


def check_model_shapes(mode, tensor, sequence_parallel, batch, seq, hidden, heads, ffn, kv_heads=None):
    """Raise ShapeError with the message of the first rule of ``model_shape_rules`` that fails."""
    for rule in model_shape_rules(mode, tensor, sequence_parallel, batch, seq, hidden, heads, ffn, kv_heads):
        if not rule.holds:
            raise ShapeError(rule.message())


def mesh_1d(T):
    return build_mesh(tensor=T, tensor_mode="1d")


def pad_to(t, shape, fill=0.0):
    """``t`` padded at the end of every dim up to ``shape`` with ``fill``."""
    if tuple(t.shape) == tuple(shape):
        return t
    pads = []
    for have, want in reversed(list(zip(t.shape, shape))):
        pads += [0, want - have]
    return F.pad(t, pads, value=fill)


def expected_shard(ref, spec, mesh):
    """This rank's block of reference tensor ``ref`` under ``spec`` (zero-padded to the spec's shape)."""
    return shard_from_global(pad_to(ref.detach(), spec.global_shape), spec, mesh)


def last_dim_shard(t, mesh):
    """My block of ``t`` split along its last dim."""
    spec = ShardSpec(tuple(t.shape), ((t.dim() - 1, "tensor"),))
    return shard_from_global(t.detach(), spec, mesh)


def seq_block(t, mesh, dim=1):
    """My sequence block of a full [b, s, ..] tensor."""
    return t.detach().chunk(mesh.tensor.size, dim)[mesh.tensor.rank].contiguous()


def compare_parameters(par, ref, mesh, what, check_grads=True):
    """Every parameter of ``par`` (and its grad) equals its shard of the same-named
    reference parameter; both modules have the same parameter names."""
    par_params, ref_params = dict(par.named_parameters()), dict(ref.named_parameters())
    assert set(par_params) == set(ref_params), f"{what}: names {sorted(par_params)} != {sorted(ref_params)}"
    for name, p in par_params.items():
        spec, r = get_spec(p), ref_params[name]
        assert spec is not None, f"{what}: {name} has no shard spec"
        assert_close(p, expected_shard(r, spec, mesh), TOL, f"{what} {name} init")
        if check_grads:
            assert p.grad is not None, f"{what}: {name} got no gradient"
            assert_close(p.grad, expected_shard(r.grad, spec, mesh), TOL, f"{what} {name}.grad")
    return len(par_params)


def local_param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())
