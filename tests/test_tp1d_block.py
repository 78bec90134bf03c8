"""The plain model laid out by ``gridshard.parallelize`` on a 1D mesh (± sequence
parallelism) equals the single-process model.

Block: a plain 1-layer ``Transformer`` with real CPU weights (torch's default init from
a fixed seed, norm weights perturbed away from 1) is laid out on ``build_mesh(tensor=T,
tensor_mode="1d")``, its sliced weights coming from the plain tensors; ``layers[0]`` (hooks
included) is fed this rank's block input (full [b, s, h], or the sequence block
[b, s/T, h] under SP) and compared with the same layer of an identical plain model on
fresh random inputs: output, input gradient, every parameter's gathered canonical value
(bit for bit) and gradient. Multi-head and grouped-query attention (kv heads split over
T, or replicated in groups of T/K when T > K).

Whole model (vocabulary 37, not divisible by T = 2 or 4; tied and untied head; MHA and
GQA): a meta-built plain model laid out on the 1D mesh against the same meta model laid
out at T=1 (same seed → the same global weights); logits block, loss and every gathered
parameter gradient.

fp32 tolerance 1e-5. The ledger of one forward + backward, the parameter bytes per rank
and the residual activation bytes must equal ``gridshard.tensor.tp1d.theory`` (per block) and what the
planner and the memory model price (the 1D scheme's ``tensor_comm``, ``rank_shape``, the model's
parameter blocks) exactly.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gridshard.comm import LEDGER
from gridshard.job_layout import TensorMode
from gridshard.parallel.rank_blocks import rank_parameter_blocks
from gridshard.theory import CommVolume
from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer
from gridshard.models.rope import rope_tables
from gridshard.parallel import gather_canonical, parallelize
from gridshard.testing import assert_close, run_on_ranks
from gridshard.tensor.tp1d import theory as tp1d

from .test_tp1d_helpers import TOL, last_dim_shard, local_param_bytes, mesh_1d, pad_to, randint, randn, seq_block

ONE_D = TensorMode("1d")
BLOCK_SHAPES = [  # (batch, seq, hidden, heads, kv_heads, ffn)
    (2, 8, 32, 4, 4, 48),
    (3, 12, 48, 4, 4, 64),
    (2, 8, 32, 4, 2, 48),     # GQA: T=2 splits the 2 kv heads, T=4 replicates each on 2 ranks
    (2, 4, 32, 8, 1, 16),     # multi-query: the single kv head replicated on every rank
]


def _assert_ledger(theory, what):
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        got = (LEDGER.count(op), LEDGER.payload_bytes(op))
        want = (theory.count(op), theory.payload_bytes(op))
        assert got == want, f"{what}: ledger {op} (count, bytes) {got} != theory {want}"
    # ring wire bytes written out here, not through the ledger's own function: on n ranks an
    # all-reduce sends 2(n-1)/n of its payload, all-gather / reduce-scatter / broadcast (n-1)/n
    n = theory.group_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "broadcast": (n - 1) / n}
    want_wire = sum(factor[op] * theory.payload_bytes(op) for op in factor)
    assert LEDGER.total("wire_bytes") == pytest.approx(want_wire), f"{what}: wire bytes"


def _plain_with_weights(cfg, seed):
    """A plain model with real, seeded CPU weights and non-trivial norm weights."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            if p.dim() == 1:
                p.copy_(1 + 0.3 * randn(p.shape, seed + 100 + k))
    return model


def _compare_grads(par_model, ref_model, mesh, what, prefix="", check_values=True):
    """Every parameter of ``par_model`` under ``prefix``: its gathered canonical value equals the
    reference's bit for bit and its gathered gradient agrees within TOL. Returns the count."""
    ctx, n = par_model.parallel_context, 0
    for name, p in par_model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix):
            continue
        ref = ref_model.get_parameter(name)
        spec = ctx.layouts[name]
        if check_values:
            assert torch.equal(gather_canonical(p, spec, mesh), ref.detach()), f"{what}: {name} value"
        assert p.grad is not None, f"{what}: {name} got no gradient"
        assert_close(gather_canonical(p.grad, spec, mesh), ref.grad, TOL, f"{what} {name}.grad")
        n += 1
    return n


def _block(T, sp):
    mesh = mesh_1d(T)
    for i, (b, s, h, heads, kv, ffn) in enumerate(BLOCK_SHAPES):
        if T > heads:
            continue
        what = f"block(T={T}, sp={sp}, b,s,h,heads,kv,ffn={b},{s},{h},{heads},{kv},{ffn})"
        seed = 50 + 7 * i + T
        cfg = ModelConfig(vocab_size=16, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=ffn, layers=1,
                          max_seq_len=16)
        ref_model = _plain_with_weights(cfg, seed)
        par_model = parallelize(_plain_with_weights(cfg, seed), mesh, sequence_parallel=sp, device="cpu")
        ref, par = ref_model.layers[0], par_model.layers[0]
        cos, sin = rope_tables(s, cfg.head_dim, cfg.rope_theta)
        X = randn((b, s, h), seed + 1).requires_grad_()
        G = randn((b, s, h), seed + 2)
        Y = ref(X, cos, sin)
        Y.backward(G)
        x = (seq_block(X, mesh) if sp else X.detach().clone()).requires_grad_()
        LEDGER.reset()
        y = par(x, cos, sin)
        y.backward(seq_block(G, mesh) if sp else G)
        _assert_ledger(tp1d.block_comm(b, s, h, T, sp, heads=heads, kv_heads=kv), what)
        assert_close(y, seq_block(Y, mesh) if sp else Y.detach(), TOL, f"{what} forward")
        assert_close(x.grad, seq_block(X.grad, mesh) if sp else X.grad, TOL, f"{what} input grad")
        n = _compare_grads(par_model, ref_model, mesh, what, prefix="layers.0.")
        assert n == 9, f"{what}: expected 9 parameters, got {n}"
        assert local_param_bytes(par) == tp1d.block_param_bytes(h, ffn, T, heads=heads, kv_heads=kv), \
            f"{what}: parameter bytes"
        assert y.numel() * y.element_size() == ONE_D.rank_shape(cfg, T, sp, b * s).residual * 4, f"{what}: residual"
    return True


def _meta_model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


def _transformer(T, sp, data=1):
    """With ``data`` > 1 the replicas see different tokens: the layers must use only the tensor group."""
    mesh = build_mesh(data=data, tensor=T, tensor_mode="1d")
    ref_mesh = build_mesh(dist.get_world_size(), 1, 1, "none")
    cases = [  # (vocab, tied, batch, seq, kv_heads)
        (37, False, 2, 8, 4),
        (37, True, 3, 4, 4),
        (37, False, 2, 8, 2),
    ]
    for k, (vocab, tied, b, s, kv) in enumerate(cases):
        what = f"transformer(T={T}, sp={sp}, V={vocab}, tied={tied}, kv_heads={kv}, b,s={b},{s})"
        seed = 90 + 11 * k + T
        data_seed = seed + 1000 * mesh.data.rank
        cfg = ModelConfig(vocab_size=vocab, hidden=32, layers=2, heads=4, kv_heads=kv, ffn_hidden=48, max_seq_len=16,
                          tie_embeddings=tied, init_std=0.05)
        ref = parallelize(_meta_model(cfg), ref_mesh, seed=seed, device="cpu")
        par = parallelize(_meta_model(cfg), mesh, sequence_parallel=sp, seed=seed, device="cpu")
        ctx, ref_ctx = par.parallel_context, ref.parallel_context
        assert (par.lm_head.weight is par.embed_tokens.weight) == tied
        tokens = randint(vocab, (b, s), data_seed + 1)
        targets = randint(vocab, (b, s), data_seed + 2)
        targets[0, 0] = -100
        targets[-1, -1] = vocab - 1
        ref_logits = ref_ctx.logits(ref, tokens)
        ref_loss = ref_ctx.loss(ref_logits, targets)
        ref_loss.backward()
        LEDGER.reset()
        logits = ctx.logits(par, ctx.shard_tokens(tokens))
        loss = ctx.loss(logits, ctx.shard_tokens(targets))
        loss.backward()
        layout = SimpleNamespace(tensor=T, sequence_parallel=sp, micro_batch=b, recompute="none")
        priced = ONE_D.tensor_comm(cfg, layout, s, cfg.layers, first=True, last=True).get("tensor", [])
        _assert_ledger(sum(priced, CommVolume(T)), what)        # what the planner prices the step with
        assert LEDGER.count(axis="tensor") == LEDGER.count(), f"{what}: a collective left the tensor axis"
        padded = -(-vocab // T) * T
        assert_close(logits, last_dim_shard(pad_to(ref_logits.detach(), (b, s, padded)), mesh), TOL, f"{what} logits")
        assert_close(loss, ref_loss.detach(), TOL, f"{what} loss")
        n = _compare_grads(par, ref, mesh, what)
        assert n == len(dict(ref.named_parameters(remove_duplicate=False))), f"{what}: {n} parameters compared"
        assert local_param_bytes(par) == 4 * sum(p.numel for p in rank_parameter_blocks(cfg, ONE_D, T)), \
            f"{what}: parameter bytes (the memory model's)"
        if T == 1:
            assert local_param_bytes(par) == cfg.num_parameters() * 4
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_block_matches_reference(T, sp):
    assert all(run_on_ranks(T, _block, T, sp, timeout=120))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_transformer_matches_reference(T, sp):
    assert all(run_on_ranks(T, _transformer, T, sp, timeout=120))


def test_transformer_on_a_data_by_tensor_mesh():
    """D=2 × T=2 on 4 ranks, different tokens per data replica, SP on."""
    assert all(run_on_ranks(4, _transformer, 2, True, 2, timeout=120))
