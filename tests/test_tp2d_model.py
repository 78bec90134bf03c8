"""The plain model laid out by ``gridshard.parallelize`` on a q×q grid (SUMMA 2D) against the
single-device model.

Block: a plain 1-layer ``Transformer`` with real CPU weights (torch's default init from a
fixed seed, norm weights perturbed away from 1) laid out on ``build_mesh(tensor=q²,
tensor_mode="2d")``; its ``layers[0]`` (hooks included) is fed block (i, j) = [b/q, s, h/q]
of a fresh random input and compared with the same layer of an identical plain model:
output, input gradient, every parameter's gathered canonical value (bit for bit) and
gradient. Whole model: a meta-built plain model laid out on the grid against the same
meta model laid out at T=1 (same seed → the same global weights): logits block, loss and
every gathered parameter gradient. Multi-head and grouped-query attention.

fp32, relative error ≤ 1e-5. The ledger of one forward+backward equals
gridshard.tensor.tp2d.theory exactly, parameters per rank equal the formula (1/q² of the
layer), and the block's saved activations per rank stay within 1.1 × one device's / q²
(saved_tensors_hooks; parameters and the RoPE tables excluded).

The shared-input q|k|v and gate|up product saves the weight parts themselves, not a
joined copy (``summa_ab_parts``): ``test_block_saves_no_weight_copies`` checks that no
saved tensor is a concatenation of weight blocks.
"""
import pytest
import torch
import torch.distributed as dist

from gridshard.comm import LEDGER
from gridshard.mesh import build_mesh
from gridshard.models import ModelConfig, Transformer
from gridshard.models.rope import rope_tables
from gridshard.parallel import gather_canonical, parallelize
from gridshard.testing import assert_close, run_on_ranks
from gridshard.tensor.tp2d import theory as tp2d

from .test_tp2d_helpers import TOL, SavedActivations, block, fresh_seed, ledger_matches, mesh_2d, pad_to, randint, randn


def _plain_with_weights(cfg, seed):
    """A plain model with real, seeded CPU weights and non-trivial norm weights."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            if p.dim() == 1:
                p.copy_(1 + 0.3 * randn(p.shape, seed + 100 + k))
    return model


def _compare_parameters(par_model, ref_model, mesh, what, prefix=""):
    """Every parameter of ``par_model`` under ``prefix``: gathered canonical value equal to the
    reference's bit for bit, gathered gradient within TOL. Returns the count."""
    ctx, n = par_model.parallel_context, 0
    for name, p in par_model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix):
            continue
        ref = ref_model.get_parameter(name)
        spec = ctx.layouts[name]
        assert torch.equal(gather_canonical(p, spec, mesh), ref.detach()), f"{what}: {name} value"
        assert p.grad is not None, f"{what}: {name} got no gradient"
        assert_close(gather_canonical(p.grad, spec, mesh), ref.grad, TOL, f"{what} {name} grad")
        n += 1
    return n


def _block(q, cases, seed):
    mesh = mesh_2d(q)
    out = []
    for k, (b, s, h, heads, kv, ffn) in enumerate(cases):
        cfg = ModelConfig(vocab_size=4 * q * q, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=ffn, layers=1,
                          max_seq_len=16)
        what = f"decoder layer q={q} b,s,h,heads,kv,ffn={b},{s},{h},{heads},{kv},{ffn} seed={seed}"
        ref_model = _plain_with_weights(cfg, seed + k)
        par_model = parallelize(_plain_with_weights(cfg, seed + k), mesh, device="cpu")
        ref, par = ref_model.layers[0], par_model.layers[0]
        cos, sin = rope_tables(s, cfg.head_dim, cfg.rope_theta)
        X = randn((b, s, h), seed + 100 + k).requires_grad_()
        G = randn((b, s, h), seed + 200 + k)
        with SavedActivations(ref, exclude=(cos, sin)) as saved_ref:
            Y = ref(X, cos, sin)
        Y.backward(G)
        x = block(X, mesh).requires_grad_()
        LEDGER.reset()
        with SavedActivations(par, exclude=(cos, sin)) as saved_par:
            y = par(x, cos, sin)
        y.backward(block(G, mesh))
        ledger_matches(tp2d.block2d_comm(b, s, h, ffn, q, heads=heads, kv_heads=kv), what)
        assert_close(y, block(Y, mesh), TOL, f"{what} forward")
        assert_close(x.grad, block(X.grad, mesh), TOL, f"{what} input grad")
        n = _compare_parameters(par_model, ref_model, mesh, what, prefix="layers.0.")
        assert n == 9, f"{what}: expected 9 parameters, got {n}"
        nbytes = sum(p.numel() * p.element_size() for p in par.parameters())
        assert nbytes == tp2d.block2d_param_bytes(h, ffn, q, heads=heads, kv_heads=kv), what
        assert saved_ref.weight_concat_bytes == 0, f"{what}: the plain layer saved a weight concatenation"
        ratio = saved_par.activation_bytes / (saved_ref.activation_bytes / q ** 2)
        assert ratio <= 1.1, (f"{what}: saved activations {saved_par.activation_bytes} B per rank = {ratio:.3f} × "
                              f"one device/q²")
        out.append((round(ratio, 4), saved_par.weight_concat_bytes))
    return out


def test_block_q2():
    res = run_on_ranks(4, _block, 2, [(2, 6, 16, 4, 4, 24), (4, 5, 8, 2, 2, 12), (2, 6, 16, 4, 2, 24)],
                       fresh_seed())
    print("(saved-activation ratio 2D per rank / (one device / q²), saved weight-copy bytes):", res[0])


def test_block_q3():
    res = run_on_ranks(9, _block, 3, [(3, 4, 18, 3, 3, 12)], fresh_seed())
    print("(saved-activation ratio 2D per rank / (one device / q²), saved weight-copy bytes):", res[0])


def test_block_saves_no_weight_copies():
    res = run_on_ranks(4, _block, 2, [(2, 6, 16, 4, 4, 24)], fresh_seed())
    copies = [c for _, c in res[0]]
    assert copies == [0], f"saved copies of concatenated weight blocks per rank: {copies} B"


def _meta_model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


def _transformer(q, b, s, vocab, h, heads, kv, ffn, layers, tied, seed):
    mesh = mesh_2d(q)
    cfg = ModelConfig(vocab_size=vocab, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=ffn, layers=layers,
                      max_seq_len=s, tie_embeddings=tied, init_std=0.1)
    what = (f"Transformer q={q} b,s,V,h,heads,kv,ffn,L={b},{s},{vocab},{h},{heads},{kv},{ffn},{layers} tied={tied} "
            f"seed={seed}")
    ref = parallelize(_meta_model(cfg), build_mesh(dist.get_world_size(), 1, 1, "none"), seed=seed, device="cpu")
    par = parallelize(_meta_model(cfg), mesh, seed=seed, device="cpu")
    ctx, ref_ctx = par.parallel_context, ref.parallel_context
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[0, -3:] = -100
    Z = ref_ctx.logits(ref, tokens)
    loss_ref = ref_ctx.loss(Z, targets)
    loss_ref.backward()
    LEDGER.reset()
    z = ctx.logits(par, ctx.shard_tokens(tokens))
    loss = ctx.loss(z, ctx.shard_tokens(targets))
    loss.backward()
    ledger_matches(tp2d.transformer2d_comm(layers, b, s, h, ffn, vocab, q, tied, heads=heads, kv_heads=kv), what)
    padded = tp2d.padded_vocab(vocab, q)
    assert_close(z, block(pad_to(Z.detach(), (b, s, padded)), mesh), TOL, f"{what} logits")
    assert_close(loss, loss_ref, TOL, f"{what} loss")
    n = _compare_parameters(par, ref, mesh, what)
    assert n == len(dict(ref.named_parameters(remove_duplicate=False))), f"{what}: {n} parameters compared"
    nbytes = sum(p.numel() * p.element_size() for p in par.parameters())
    assert nbytes == tp2d.transformer2d_param_bytes(layers, h, ffn, vocab, q, tied, heads=heads, kv_heads=kv), what
    return float(loss.detach())


@pytest.mark.parametrize("tied,kv", [(False, 4), (True, 4), (False, 2)], ids=["untied", "tied", "gqa"])
def test_transformer_q2(tied, kv):
    losses = run_on_ranks(4, _transformer, 2, 4, 8, 37, 16, 4, kv, 24, 2, tied, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def test_transformer_q3():
    losses = run_on_ranks(9, _transformer, 3, 3, 4, 20, 18, 3, 3, 12, 1, False, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"
