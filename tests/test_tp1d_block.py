"""The reference model laid out by Megatron1DStyle equals the single-process model.

``TransformerBlock`` and the whole ``Transformer`` (vocabulary 37, not divisible by
T = 2 or 4; tied and untied head) are built from the same seed with
``Megatron1DStyle(mesh, sp)`` and with ``NoTensorParallel``; on fresh random inputs
the output, input gradient, loss and every parameter (value and gradient) must
agree to 1e-5, and the ledger, parameter bytes and residual bytes must equal
``gridshard.theory.tp1d``.
"""
import pytest
import torch

from gridshard.comm import LEDGER
from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer, TransformerBlock
from gridshard.nn import make_style
from gridshard.nn.style import NoTensorParallel
from gridshard.nn.style_1d import Megatron1DStyle
from gridshard.testing import assert_close, run_on_ranks
from gridshard.theory import tp1d

from .test_tp1d_helpers import (TOL, compare_parameters, last_dim_shard, local_param_bytes, mesh_1d, pad_to,
                                randint, randn, seq_block)

BLOCK_SHAPES = [  # (batch, seq, hidden, heads, ffn)
    (2, 8, 32, 4, 48),
    (3, 12, 48, 4, 64),
]


def _assert_ledger(theory, what):
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        got = (LEDGER.count(op), LEDGER.payload_bytes(op))
        want = (theory.count(op), theory.payload_bytes(op))
        assert got == want, f"{what}: ledger {op} (count, bytes) {got} != theory {want}"
    assert LEDGER.total("wire_bytes") == pytest.approx(theory.wire_bytes()), f"{what}: wire bytes"


def _block(T, sp):
    mesh = mesh_1d(T)
    for i, (b, s, h, heads, ffn) in enumerate(BLOCK_SHAPES):
        what = f"block(T={T}, sp={sp}, b,s,h,heads,ffn={b},{s},{h},{heads},{ffn})"
        seed = 50 + 7 * i + T
        cfg = ModelConfig(hidden=h, heads=heads, ffn_hidden=ffn, layers=2, max_seq_len=16, init_std=0.05)
        style = Megatron1DStyle(mesh, sequence_parallel=sp)
        style.check_shapes(b, s, h, heads, ffn, cfg.vocab_size)
        torch.manual_seed(seed)
        ref = TransformerBlock(cfg, NoTensorParallel(None))
        torch.manual_seed(seed)
        par = TransformerBlock(cfg, style)
        X = randn((b, s, h), seed + 1).requires_grad_()
        G = randn((b, s, h), seed + 2)
        Y = ref(X)
        Y.backward(G)
        x = (seq_block(X, mesh) if sp else X.detach().clone()).requires_grad_()
        LEDGER.reset()
        y = par(x)
        y.backward(seq_block(G, mesh) if sp else G)
        assert_close(y, seq_block(Y, mesh) if sp else Y.detach(), TOL, f"{what} forward")
        assert_close(x.grad, seq_block(X.grad, mesh) if sp else X.grad, TOL, f"{what} input grad")
        n = compare_parameters(par, ref, mesh, what)
        assert n == 6, f"{what}: expected 6 parameters, got {n}"
        _assert_ledger(tp1d.block_comm(b, s, h, T, sp), what)
        assert local_param_bytes(par) == tp1d.block_param_bytes(h, ffn, T), f"{what}: parameter bytes"
        assert y.numel() * y.element_size() == tp1d.residual_activation_bytes(b, s, h, T, sp), f"{what}: residual"
    return True


def _transformer(T, sp, data=1):
    """With ``data`` > 1 the replicas see different tokens: the layers must use only the tensor group."""
    mesh = build_mesh(data=data, tensor=T, tensor_mode="1d")
    cases = [  # (vocab, tied, batch, seq)
        (37, False, 2, 8),
        (37, True, 3, 4),
    ]
    for k, (vocab, tied, b, s) in enumerate(cases):
        what = f"transformer(T={T}, sp={sp}, V={vocab}, tied={tied}, b,s={b},{s})"
        seed = 90 + 11 * k + T + 1000 * mesh.data.rank
        cfg = ModelConfig(vocab_size=vocab, hidden=32, layers=2, heads=4, ffn_hidden=48, max_seq_len=16,
                          tie_embeddings=tied, init_std=0.05)
        style = make_style(mesh, sequence_parallel=sp) if T > 1 else Megatron1DStyle(mesh, sp)
        assert isinstance(style, Megatron1DStyle)
        style.check_shapes(b, s, cfg.hidden, cfg.heads, cfg.ffn_hidden, vocab)
        torch.manual_seed(seed)
        ref = Transformer(cfg, NoTensorParallel(None))
        torch.manual_seed(seed)
        par = Transformer(cfg, style)
        assert (par.head.weight is par.embed.weight) == tied
        tokens = randint(vocab, (b, s), seed + 1)
        targets = randint(vocab, (b, s), seed + 2)
        targets[0, 0] = -100
        targets[-1, -1] = vocab - 1
        ref_logits = ref(tokens)
        ref_loss = ref.style.loss(ref_logits, targets)
        ref_loss.backward()
        LEDGER.reset()
        logits = par(style.shard_tokens(tokens))
        loss = style.loss(logits, style.shard_tokens(targets))
        loss.backward()
        padded = -(-vocab // T) * T
        assert_close(logits, last_dim_shard(pad_to(ref_logits.detach(), (b, s, padded)), mesh), TOL, f"{what} logits")
        assert_close(loss, ref_loss.detach(), TOL, f"{what} loss")
        compare_parameters(par, ref, mesh, what)
        _assert_ledger(tp1d.transformer_comm(cfg.layers, b, s, cfg.hidden, T, sp), what)
        assert LEDGER.count(axis="tensor") == LEDGER.count(), f"{what}: a collective left the tensor axis"
        assert local_param_bytes(par) == tp1d.transformer_param_bytes(cfg.layers, cfg.hidden, cfg.ffn_hidden, vocab,
                                                                      T, tied), f"{what}: parameter bytes"
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
