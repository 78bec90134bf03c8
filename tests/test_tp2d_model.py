"""The 2D TransformerBlock and the whole tiny Transformer (Summa2DStyle) against NoTensorParallel.

Same seed → same global model; fresh random inputs; fp32, relative error ≤ 1e-5 on
the output (logits), the loss, the input gradient and every parameter gradient.
The ledger of one forward+backward equals gridshard.theory.tp2d exactly, parameters
per rank equal the formula (1/q² of the layer), and the block's saved activations
per rank stay within 1.1 × one device's / q² (saved_tensors_hooks).
"""
import pytest
import torch

from gridshard.comm import LEDGER
from gridshard.models import ModelConfig, Transformer, TransformerBlock
from gridshard.nn.style import NoTensorParallel
from gridshard.nn.style_2d import Summa2DStyle
from gridshard.testing import assert_close, run_on_ranks
from gridshard.theory import tp2d

from .test_tp2d_helpers import (TOL, SavedActivations, block, compare_parameters, expected_shard, fresh_seed, ledger_matches,
                                mesh_2d, pad_to, randint, randn)


def _block(q, cases, seed):
    mesh = mesh_2d(q)
    ratios = []
    for k, (b, s, h, heads, ffn) in enumerate(cases):
        cfg = ModelConfig(hidden=h, heads=heads, ffn_hidden=ffn, layers=2, max_seq_len=16, init_std=0.1)
        what = f"TransformerBlock q={q} b,s,h,heads,ffn={b},{s},{h},{heads},{ffn} seed={seed}"
        torch.manual_seed(seed + k)
        ref = TransformerBlock(cfg, NoTensorParallel(None))
        torch.manual_seed(seed + k)
        par = TransformerBlock(cfg, Summa2DStyle(mesh))
        with torch.no_grad():  # non-trivial norm weights
            for name in ("attn_norm", "mlp_norm"):
                w = randn((h,), seed + 50 + len(name)) * 0.3 + 1
                getattr(ref, name).weight.copy_(w)
                pw = getattr(par, name).weight
                pw.copy_(expected_shard(w, pw.shard_spec, mesh))
        X = randn((b, s, h), seed + 100 + k).requires_grad_()
        G = randn((b, s, h), seed + 200 + k)
        with SavedActivations(ref) as saved_ref:
            Y = ref(X)
        Y.backward(G)
        x = block(X, mesh).requires_grad_()
        LEDGER.reset()
        with SavedActivations(par) as saved_par:
            y = par(x)
        assert_close(y, block(Y, mesh), TOL, f"{what} forward")
        y.backward(block(G, mesh))
        assert_close(x.grad, block(X.grad, mesh), TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh, what)
        ledger_matches(tp2d.block2d_comm(b, s, h, ffn, q), what)
        nbytes = sum(p.numel() * p.element_size() for p in par.parameters())
        assert nbytes == tp2d.block2d_param_bytes(h, ffn, q), what
        ratio = saved_par.nbytes / (saved_ref.nbytes / q ** 2)
        assert ratio <= 1.1, f"{what}: saved activations {saved_par.nbytes} B per rank = {ratio:.3f} × one device/q²"
        ratios.append(round(ratio, 4))
    return ratios


def test_block_q2():
    ratios = run_on_ranks(4, _block, 2, [(2, 6, 16, 4, 24), (4, 5, 8, 2, 12)], fresh_seed())
    print("saved-activation ratio (2D per rank / (one device / q²)):", ratios[0])


def test_block_q3():
    ratios = run_on_ranks(9, _block, 3, [(3, 4, 18, 3, 12)], fresh_seed())
    print("saved-activation ratio (2D per rank / (one device / q²)):", ratios[0])


def _transformer(q, b, s, vocab, h, heads, ffn, layers, tied, seed):
    mesh = mesh_2d(q)
    cfg = ModelConfig(vocab_size=vocab, hidden=h, heads=heads, ffn_hidden=ffn, layers=layers, max_seq_len=s,
                      tie_embeddings=tied, init_std=0.1)
    what = f"Transformer q={q} b,s,V,h,heads,ffn,L={b},{s},{vocab},{h},{heads},{ffn},{layers} tied={tied} seed={seed}"
    style = Summa2DStyle(mesh)
    style.check_shapes(b, s, h, heads, ffn, vocab)
    torch.manual_seed(seed)
    ref = Transformer(cfg, NoTensorParallel(None))
    torch.manual_seed(seed)
    par = Transformer(cfg, style)
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[0, -3:] = -100
    Z = ref(tokens)
    loss_ref = ref.style.loss(Z, targets)
    loss_ref.backward()
    LEDGER.reset()
    z = par(style.shard_tokens(tokens))
    assert_close(z, block(pad_to(Z.detach(), (b, s, par.head.padded_vocab)), mesh), TOL, f"{what} logits")
    loss = par.style.loss(z, style.shard_tokens(targets))
    assert_close(loss, loss_ref, TOL, f"{what} loss")
    loss.backward()
    compare_parameters(par, ref, mesh, what)
    ledger_matches(tp2d.transformer2d_comm(layers, b, s, h, ffn, vocab, q, tied), what)
    nbytes = sum(p.numel() * p.element_size() for p in par.parameters())
    assert nbytes == tp2d.transformer2d_param_bytes(layers, h, ffn, vocab, q, tied), what
    return float(loss.detach())


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_q2(tied):
    losses = run_on_ranks(4, _transformer, 2, 4, 8, 37, 16, 4, 24, 2, tied, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def test_transformer_q3():
    losses = run_on_ranks(9, _transformer, 3, 3, 4, 20, 18, 3, 12, 1, False, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"
