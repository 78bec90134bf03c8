"""2.5D (Tesseract) layers against plain single-process PyTorch on the same global weights.

(q, d) = (2, 2) on 8 ranks, fresh random inputs, fp32, relative error ≤ 1e-5: forward
output, input gradient and every parameter gradient of Linear2p5D (with and without bias),
RMSNorm2p5D, LayerNorm2p5D, VocabParallelEmbedding2p5D, Embedding2p5D, the LM head (untied
and tied) with cross_entropy_2p5d (padded vocabulary, masked targets, logits up to 1e4); the
ledger equals gridshard.theory.tp2p5d exactly; parameters are 1/q² of the layer and saved
activations 1/(d·q²) of one device's; d = 1 equals 2D bit for bit; a bad id in any batch block
raises the same error on every rank; the ViT path (split_batch_2p5d, PatchEmbedding2p5D,
ClsClassifier2p5D, classification_loss_2p5d) at d = 2 and d = 1. `make test` runs one 8-rank
case (the linear → norm → linear chain over two accumulated micro-batches) and two checks
without ranks; the others are marked wide (`make test-all`).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gridshard.comm import LEDGER
from gridshard.comm.depth_ops import reduce_grads_over_depth
from gridshard.comm.mesh_2p5d import build_mesh_2p5d, valid_2p5d_shapes, validate_2p5d
from gridshard.errors import LayoutError, ShapeError
from gridshard.mesh import Axis
from gridshard.comm.grid_ops import split_batch
from gridshard.nn.classification_loss import classification_loss
from gridshard.nn.classifier_2d import ClsClassifier2D, VocabParallelClassifier2D
from gridshard.nn.cross_entropy_2d import cross_entropy_2d
from gridshard.nn.cross_entropy_2p5d import cross_entropy_2p5d
from gridshard.nn.embedding_2d import Embedding2D, VocabParallelEmbedding2D
from gridshard.nn.embedding_2p5d import Embedding2p5D, VocabParallelEmbedding2p5D
from gridshard.nn.linear_2d import Linear2D
from gridshard.nn.linear_2p5d import Linear2p5D, TiedVocabHead2p5D, VocabParallelClassifier2p5D
from gridshard.nn.norm_2d import LayerNorm2D, RMSNorm2D
from gridshard.nn.norm_2p5d import LayerNorm2p5D, RMSNorm2p5D
from gridshard.nn.patch_embedding_2d import PatchEmbedding2D
from gridshard.nn.vision_2p5d import ClsClassifier2p5D, PatchEmbedding2p5D, classification_loss_2p5d, split_batch_2p5d
from gridshard.nn.sharding import ShardSpec
from gridshard.testing import assert_close, run_on_ranks
from gridshard.testing.plain import plain_embedding, plain_lm_head, plain_linear
from gridshard.theory import tp2d, tp2p5d

from .test_tp2d_helpers import (TOL, SavedActivations, compare_parameters, expected_shard, fresh_seed, mesh_2d,
                                pad_to, randint, randn)
from .test_tp2d_layers import _PlainPatchEmbedding


def _blk(t, mesh, hidden=True):
    """My block (batch block k·q + i, hidden block j) with its own storage."""
    return mesh.batch_block(t.detach(), hidden=hidden).clone(memory_format=torch.contiguous_format)


def _ledger_matches(vol, what):
    """The ledger's (op, axis) entries equal a tp2p5d volume exactly (calls and payload bytes)."""
    seen = {(op, axis): (e.count, e.payload_bytes) for (op, axis), e in LEDGER.entries.items() if e.count}
    expect = {(op, axis): (v.calls[op], v.payload[op]) for axis, v in vol.items() for op in v.calls}
    assert seen == expect, f"{what}: ledger {sorted(seen.items())} != theory {sorted(expect.items())}"


def _set_vector(par_p, ref_p, mesh, base, seed):
    """A non-trivial bias / norm vector on both sides."""
    with torch.no_grad():
        ref_p.copy_(randn(ref_p.shape, seed) * 0.5 + base)
        par_p.copy_(expected_shard(ref_p, par_p.shard_spec, mesh.grid))


# ---- the make-test case: linear → RMSNorm → linear, two accumulated micro-batches -------------------------------
def _chain(q, d, b, s, fin, fmid, fout, seed):
    """Gradients accumulate over two micro-batches exactly (each backward's part is summed over
    depth once, before it is added to .grad); ledger of one micro-batch = theory; parameters 1/q²
    and the first linear's saved input 1/(d·q²) of one device's."""
    mesh = build_mesh_2p5d(q, d)
    what = f"Linear2p5D→RMSNorm2p5D→Linear2p5D q={q} d={d} b,s={b},{s} {fin}→{fmid}→{fout} seed={seed}"
    torch.manual_seed(seed)
    ref = nn.Sequential(plain_linear(fin, fmid, True, 0.1), nn.RMSNorm(fmid, eps=1e-5),
                        plain_linear(fmid, fout, False, 0.1))
    torch.manual_seed(seed)
    par = nn.Sequential(Linear2p5D(fin, fmid, mesh, bias=True, init_std=0.1), RMSNorm2p5D(fmid, mesh, eps=1e-5),
                        Linear2p5D(fmid, fout, mesh, bias=False, init_std=0.1))
    _set_vector(par[0].bias, ref[0].bias, mesh, 0.0, seed + 1)
    _set_vector(par[1].weight, ref[1].weight, mesh, 1.0, seed + 2)
    n = b * s
    for micro in range(2):
        X = randn((b, s, fin), seed + 10 + micro).requires_grad_()
        G = randn((b, s, fout), seed + 20 + micro)
        with SavedActivations(ref[0]) as saved_ref:        # the first linear alone
            H = ref[0](X)
        Y = ref[2](ref[1](H))
        Y.backward(G)
        x = _blk(X, mesh).requires_grad_()
        LEDGER.reset()
        with SavedActivations(par[0]) as saved_par:
            y = par[0](x)
        y = par[2](par[1](y))
        assert_close(y, _blk(Y, mesh), TOL, f"{what} micro-batch {micro} forward")
        y.backward(_blk(G, mesh))
        assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} micro-batch {micro} input grad")
        _ledger_matches(tp2p5d.combine(tp2p5d.linear2p5d_comm(n, fin, fmid, q, d, bias=True),
                                       tp2p5d.rmsnorm2p5d_comm(n, fmid, q, d),
                                       tp2p5d.linear2p5d_comm(n, fmid, fout, q, d)), f"{what} micro-batch {micro}")
    compare_parameters(par, ref, mesh.grid, f"{what} after 2 micro-batches")
    assert saved_par.nbytes == tp2p5d.linear2p5d_saved_activation_bytes(n, fin, q, d), what
    assert saved_par.nbytes * d * q * q == saved_ref.nbytes, (what, saved_par.nbytes, saved_ref.nbytes)
    nbytes = sum(p.numel() * 4 for p in par[0].parameters())
    assert nbytes == tp2p5d.linear2p5d_param_bytes(fin, fmid, q, 4, bias=True), what
    assert nbytes * q * q == sum(p.numel() * 4 for p in ref[0].parameters()), what
    return True


@pytest.mark.wide                     # 8 ranks: a worker pool of its own; make test-all runs it
def test_linear_norm_chain_q2_d2_two_micro_batches():
    assert all(run_on_ranks(8, _chain, 2, 2, 4, 3, 8, 16, 12, fresh_seed()))


# ---- pure checks (no ranks) --------------------------------------------------------------------------------------
def test_layout_validation_and_theory_at_d1_is_2d():
    validate_2p5d(8, 2, 2)
    validate_2p5d(18, 3, 2)
    assert valid_2p5d_shapes(16) == [(2, 4), (4, 1)]
    for args, match in (((8, 2, 3), "q²·d = 12"), ((8, 1, 8), "q=1"), ((8, 2, 0), "d=0"), ((7, 2, 2), "none")):
        with pytest.raises(LayoutError, match=match) as err:
            validate_2p5d(*args)
        assert "Fix:" in str(err.value)
    n, h, f, v, q = 24, 16, 32, 13, 2
    assert tp2p5d.linear2p5d_comm(n, h, f, q, 1, bias=True) == tp2p5d.lift(tp2d.linear2d_comm(n, h, f, q, 4, True),
                                                                           q, 1)
    assert tp2p5d.rmsnorm2p5d_comm(n, h, q, 1) == tp2p5d.lift(tp2d.rmsnorm2d_comm(n, h, q), q, 1)
    assert tp2p5d.cross_entropy2p5d_comm(n, q, 1) == tp2p5d.lift(tp2d.cross_entropy2d_comm(n, q), q, 1)
    assert tp2p5d.embedding2p5d_comm(4, 6, h, v, q, 1) == tp2p5d.lift(tp2d.embedding2d_comm(4, 6, h, q), q, 1)
    # d = 2: the 2D volume of N/2 tokens, plus the weight and bias blocks summed over depth
    lin = tp2p5d.linear2p5d_comm(n, h, f, q, 2, bias=True)
    assert lin["depth"].calls == {"all_reduce": 2}
    assert lin["depth"].payload == {"all_reduce": (h * f // q ** 2 + f // q ** 2) * 4}
    assert tp2p5d.rounds(lin) == 2 * q + 4 + 2 + 2
    with pytest.raises(ValueError, match="not divisible by the depth"):
        tp2p5d.linear2p5d_comm(3, h, f, q, 2)


def test_a_parameter_is_reduced_over_depth_once():
    """Registering a parameter twice (a tied head re-registering the embedding's table) is refused:
    its gradient would be summed over depth twice (d× too large). Registration runs no collective."""
    depth = Axis("depth", 2, 0, (0, 1), None)
    lin = nn.Linear(4, 4, bias=False)
    lin.weight.shard_spec = ShardSpec((4, 4))
    assert len(reduce_grads_over_depth(lin, depth)) == 1
    assert lin.weight.shard_spec.partial_grad_axes == ("depth",)
    with pytest.raises(LayoutError, match="already has its gradient summed over depth"):
        reduce_grads_over_depth(lin, depth)
    assert reduce_grads_over_depth(nn.Linear(2, 2), Axis("depth", 1, 0, (0,), None)) == []   # d = 1: 2D


# ---- every layer, wide ----------------------------------------------------------------------------------------------
def _linears(q, d, cases, seed):
    mesh = build_mesh_2p5d(q, d)
    for k, (b, s, fin, fout, bias) in enumerate(cases):
        what = f"Linear2p5D q={q} d={d} b,s,in,out={b},{s},{fin},{fout} bias={bias} seed={seed}"
        torch.manual_seed(seed + k)
        ref = plain_linear(fin, fout, bias, 0.05)
        torch.manual_seed(seed + k)
        par = Linear2p5D(fin, fout, mesh, bias=bias, init_std=0.05)
        if bias:
            _set_vector(par.bias, ref.bias, mesh, 0.0, seed + 50 + k)
        X = randn((b, s, fin), seed + 100 + k).requires_grad_()
        G = randn((b, s, fout), seed + 200 + k)
        ref(X).backward(G)
        x = _blk(X, mesh).requires_grad_()
        LEDGER.reset()
        y = par(x)
        assert_close(y, _blk(ref(X), mesh), TOL, f"{what} forward")
        y.backward(_blk(G, mesh))
        assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh.grid, what)
        _ledger_matches(tp2p5d.linear2p5d_comm(b * s, fin, fout, q, d, bias=bias), what)
    return True


@pytest.mark.wide
def test_linear_q2_d2_shapes():
    cases = [(4, 3, 8, 12, True), (8, 2, 12, 16, False), (4, 1, 4, 8, True)]
    assert all(run_on_ranks(8, _linears, 2, 2, cases, fresh_seed()))


def _norms(q, d, b, s, h, seed):
    mesh = build_mesh_2p5d(q, d)
    for kind, ref_cls, par_cls, comm in (("rms", nn.RMSNorm, RMSNorm2p5D, tp2p5d.rmsnorm2p5d_comm),
                                         ("layer", nn.LayerNorm, LayerNorm2p5D, tp2p5d.layernorm2p5d_comm)):
        what = f"{kind}norm2p5d q={q} d={d} b,s,h={b},{s},{h} seed={seed}"
        ref, par = ref_cls(h, eps=1e-5), par_cls(h, mesh, eps=1e-5)
        for name, p in ref.named_parameters():
            _set_vector(getattr(par, name), p, mesh, 1.0 if name == "weight" else 0.0, seed + len(name))
        X = (randn((b, s, h), seed + 10) * 3 + 1).requires_grad_()
        G = randn((b, s, h), seed + 20)
        Y = ref(X)
        Y.backward(G)
        x = _blk(X, mesh).requires_grad_()
        LEDGER.reset()
        y = par(x)
        assert_close(y, _blk(Y, mesh), TOL, f"{what} forward")
        y.backward(_blk(G, mesh))
        assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh.grid, what)
        _ledger_matches(comm(b * s, h, q, d), what)
    return True


@pytest.mark.wide
def test_norms_q2_d2():
    assert all(run_on_ranks(8, _norms, 2, 2, 4, 3, 12, fresh_seed()))


def _embeddings(q, d, b, s, vocab, h, seed):
    mesh = build_mesh_2p5d(q, d)
    tokens = randint(vocab, (b, s), seed + 1)
    tokens[0, 0], tokens[-1, -1] = 0, vocab - 1
    for cls, width, comm in ((VocabParallelEmbedding2p5D, h, tp2p5d.embedding2p5d_comm),
                             (Embedding2p5D, h * q, tp2p5d.embedding_full2p5d_comm)):
        what = f"{cls.__name__} q={q} d={d} b,s,V,h={b},{s},{vocab},{width} seed={seed}"
        torch.manual_seed(seed)
        ref = plain_embedding(vocab, width, 0.1)
        torch.manual_seed(seed)
        par = cls(vocab, width, mesh, 0.1)
        G = randn((b, s, width), seed + 2)
        Y = ref(tokens)
        Y.backward(G)
        LEDGER.reset()
        y = par(_blk(tokens, mesh, hidden=False))
        assert_close(y, _blk(Y, mesh), TOL, f"{what} forward")
        y.backward(_blk(G, mesh))
        compare_parameters(par, ref, mesh.grid, what)
        _ledger_matches(comm(b, s, width, vocab, q, d), what)
    return True


@pytest.mark.wide
def test_embeddings_q2_d2_vocab_not_divisible():
    assert all(run_on_ranks(8, _embeddings, 2, 2, 4, 3, 13, 8, fresh_seed()))


def _head_and_loss(q, d, b, s, vocab, h, tied, scale, seed):
    """Embedding → (+ X) → head → loss, masked targets, logits scaled to |z| ~ ``scale``."""
    mesh = build_mesh_2p5d(q, d)
    what = f"LM head tied={tied} + cross_entropy_2p5d q={q} d={d} b,s,V,h={b},{s},{vocab},{h} |z|~{scale} seed={seed}"
    torch.manual_seed(seed)
    ref_emb = plain_embedding(vocab, h, 0.1)
    ref_head = plain_lm_head(h, vocab, 0.1, tied=ref_emb if tied else None)
    torch.manual_seed(seed)
    par_emb = VocabParallelEmbedding2p5D(vocab, h, mesh, 0.1)
    par_head = TiedVocabHead2p5D(par_emb) if tied else VocabParallelClassifier2p5D(h, vocab, mesh, init_std=0.1)
    ref, par = nn.ModuleDict(dict(emb=ref_emb, head=ref_head)), nn.ModuleDict(dict(emb=par_emb, head=par_head))
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[0, :2] = -100                          # masked, in batch block 0
    targets[b // 2] = -100                         # a whole batch block of depth layer 1 masked
    targets[-1, -1] = vocab - 1                    # the last real column, next to the padding
    X = randn((b, s, h), seed + 3).requires_grad_()
    Z = ref_head(ref_emb(tokens) + X) * scale
    loss_ref = F.cross_entropy(Z.reshape(-1, vocab), targets.reshape(-1))
    loss_ref.backward()
    x = _blk(X, mesh).requires_grad_()
    LEDGER.reset()
    z = par_head(par_emb(_blk(tokens, mesh, hidden=False)) + x) * scale
    assert_close(z, _blk(pad_to(Z.detach(), (b, s, par_emb.padded_vocab)), mesh), TOL, f"{what} logits")
    loss = cross_entropy_2p5d(z, _blk(targets, mesh, hidden=False), mesh, vocab)
    assert_close(loss, loss_ref, TOL, f"{what} loss")
    loss.backward()
    assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} input grad")
    compare_parameters(par, ref, mesh.grid, what)
    n = b * s
    head = tp2p5d.tied_head2p5d_comm(n, h, vocab, q, d) if tied else tp2p5d.head2p5d_comm(n, h, vocab, q, d)
    _ledger_matches(tp2p5d.combine(tp2p5d.embedding2p5d_comm(b, s, h, vocab, q, d), head,
                                   tp2p5d.cross_entropy2p5d_comm(n, q, d)), what)
    return float(loss.detach())


@pytest.mark.wide
@pytest.mark.parametrize("tied,scale", [(False, 1.0), (True, 1.0), (False, 1e4), (True, 1e4)])
def test_lm_head_and_cross_entropy_q2_d2(tied, scale):
    losses = run_on_ranks(8, _head_and_loss, 2, 2, 8, 3, 11, 8, tied, scale, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def _loss_edges(q, d, seed):
    """``reduction="sum"`` equals F.cross_entropy's sum; all targets masked: NaN mean, zero gradient."""
    mesh = build_mesh_2p5d(q, d)
    b, s, v = 2 * d * q, 3, 7
    Z = (randn((b, s, v), seed) * 1e4).requires_grad_()
    targets = randint(v, (b, s), seed + 1)
    targets[1] = -100
    F.cross_entropy(Z.reshape(-1, v), targets.reshape(-1), reduction="sum").backward()
    vp = -(-v // q) * q
    z = _blk(pad_to(Z.detach(), (b, s, vp)), mesh).requires_grad_()
    loss = cross_entropy_2p5d(z, _blk(targets, mesh, hidden=False), mesh, v, reduction="sum")
    loss_ref = F.cross_entropy(Z.detach().reshape(-1, v), targets.reshape(-1), reduction="sum")
    assert_close(loss, loss_ref, TOL, f"sum loss q={q} d={d} seed={seed}")
    loss.backward()
    assert_close(z.grad, _blk(pad_to(Z.grad, (b, s, vp)), mesh), TOL, f"sum loss grad seed={seed}")
    z = z.detach().requires_grad_()
    loss = cross_entropy_2p5d(z, torch.full_like(_blk(targets, mesh, hidden=False), -100), mesh, v)
    loss.backward()
    assert torch.isnan(loss) and torch.equal(z.grad, torch.zeros_like(z)), (loss, z.grad.abs().max())
    return True


@pytest.mark.wide
def test_loss_sum_and_all_masked_q2_d2():
    assert all(run_on_ranks(8, _loss_edges, 2, 2, fresh_seed()))


# ---- d = 1 is 2D, bit for bit ---------------------------------------------------------------------------------------
def _d1_equals_2d(q, seed):
    """Every 2.5D layer at d = 1 gives exactly (torch.equal) the 2D layer's output, input gradient
    and parameter gradients, and the same ledger."""
    m25, m2 = build_mesh_2p5d(q, 1), mesh_2d(q)
    b, s, h, vocab = 2 * q, 3, 4 * q, 11
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[0, 0] = -100
    X = randn((b, s, h), seed + 3)
    pairs = [(lambda m: Linear2p5D(h, h * q, m, bias=True, init_std=0.1), lambda m: Linear2D(h, h * q, m, init_std=0.1)),
             (lambda m: RMSNorm2p5D(h, m), lambda m: RMSNorm2D(h, m)),
             (lambda m: LayerNorm2p5D(h, m), lambda m: LayerNorm2D(h, m)),
             (lambda m: VocabParallelEmbedding2p5D(vocab, h, m, 0.1), lambda m: VocabParallelEmbedding2D(vocab, h, m, 0.1)),
             (lambda m: Embedding2p5D(vocab, h, m, 0.1), lambda m: Embedding2D(vocab, h, m, 0.1)),
             (lambda m: VocabParallelClassifier2p5D(h, vocab, m, init_std=0.1),
              lambda m: VocabParallelClassifier2D(h, vocab, m, init_std=0.1))]
    results = []
    for make25, make2 in pairs:
        for mesh, make in ((m25, make25), (m2, make2)):
            torch.manual_seed(seed)
            layer = make(mesh)
            LEDGER.reset()
            if isinstance(layer, (VocabParallelEmbedding2D, Embedding2D)):
                x = tokens.chunk(q, 0)[m2.grid_row].clone()
            else:
                x = X.chunk(q, 0)[m2.grid_row].chunk(q, -1)[m2.grid_col].clone().requires_grad_()
            y = layer(x)
            if isinstance(layer, VocabParallelClassifier2D):
                t = targets.chunk(q, 0)[m2.grid_row]
                y = cross_entropy_2p5d(y, t, mesh, vocab) if mesh is m25 else cross_entropy_2d(y, t, mesh, vocab)
                y.backward()
            else:
                y.backward(torch.ones_like(y) * 0.5 + y.detach())
            grads = [p.grad for p in layer.parameters()] + ([x.grad] if x.requires_grad else [])
            results.append((y.detach(), grads, dict((k, (e.count, e.payload_bytes)) for k, e in LEDGER.entries.items())))
        (y25, g25, l25), (y2, g2, l2) = results[-2:]
        name = type(layer).__name__
        assert torch.equal(y25, y2), f"{name}: d=1 output differs from 2D seed={seed}"
        assert all(torch.equal(a, c) for a, c in zip(g25, g2)) and len(g25) == len(g2), f"{name}: grads differ"
        assert l25 == l2, f"{name}: ledger {l25} != 2D {l2}"
    return True


@pytest.mark.wide
def test_d1_is_2d_bit_for_bit():
    assert all(run_on_ranks(4, _d1_equals_2d, 2, fresh_seed()))


# ---- bad ids: the same error on every rank, before the layers' own collectives ------------------------------------
def _bad_ids(q, d, where, seed):
    """A bad token (embedding) or target (loss) in one batch block only: every rank raises the same
    ShapeError after the one depth_col verdict all-reduce, none waits in a later collective."""
    mesh = build_mesh_2p5d(q, d)
    vocab, b, s, h = 11, 2 * d * q, 3, 4 * q
    bad_block = where
    ids = randint(vocab, (b, s), seed)
    ids[bad_block * b // (d * q)] = vocab + 5
    out = []
    for kind in ("embedding", "loss"):
        LEDGER.reset()
        try:
            if kind == "embedding":
                VocabParallelEmbedding2p5D(vocab, h, mesh)(_blk(ids, mesh, hidden=False))
            else:
                z = torch.zeros(b // (d * q), s, -(-vocab // q))
                cross_entropy_2p5d(z, _blk(ids, mesh, hidden=False), mesh, vocab)
            raise AssertionError(f"{kind}: bad id in block {bad_block} was accepted")
        except ShapeError as e:
            assert f"id {vocab + 5}" in str(e) and f"batch block {bad_block}" in str(e) and "Fix:" in str(e), e
            out.append(str(e))
        calls = {k: e.count for k, e in LEDGER.entries.items() if e.count}
        assert calls == {("all_reduce", "depth_col"): 1}, (kind, calls)
    return out


@pytest.mark.wide
@pytest.mark.parametrize("where", [0, 3])
def test_bad_id_in_one_block_raises_on_every_rank(where):
    messages = run_on_ranks(8, _bad_ids, 2, 2, where, fresh_seed())
    assert len({tuple(m) for m in messages}) == 1, messages


# ---- the ViT path: split_batch → PatchEmbedding2p5D → ClsClassifier2p5D → classification loss -------------------
def _vit_path(q, d, b, img, patch, chans, h, classes, seed):
    """Patch embeddings, logits, the image gradient through split_batch_2p5d (row all-reduce,
    depth_col all-gather), every parameter gradient and the mean loss (a label masked) against one
    process; d = 1 is checked bit for bit against the 2D layers by the same seed."""
    mesh = build_mesh_2p5d(q, d)
    what = f"PatchEmbedding2p5D→ClsClassifier2p5D q={q} d={d} b={b} img={img} h={h} C={classes} seed={seed}"
    torch.manual_seed(seed)
    ref_pe, ref_cls = _PlainPatchEmbedding(img, patch, chans, h, 0.1), plain_linear(h, classes, True, 0.1)
    torch.manual_seed(seed)
    par_pe = PatchEmbedding2p5D(img, patch, chans, h, mesh, 0.1)
    par_cls = ClsClassifier2p5D(h, classes, mesh, bias=True, init_std=0.1)
    with torch.no_grad():
        ref_cls.bias.copy_(torch.linspace(-1, 1, classes))
        par_cls.bias.copy_(ref_cls.bias)
    images = randn((b, chans, img, img), seed + 1).requires_grad_()
    labels = randint(classes, (b,), seed + 2)
    labels[-1] = -100
    E = ref_pe(images)
    loss_ref = F.cross_entropy(ref_cls(E[:, 0]), labels)
    GE = randn(E.shape, seed + 3)                   # also a gradient straight into the embeddings
    torch.autograd.backward([loss_ref, E], [torch.ones(()), GE])
    mine = images.detach().clone().requires_grad_()
    e = par_pe(split_batch_2p5d(mine, mesh))
    assert_close(e, _blk(E, mesh), TOL, f"{what} patch embeddings")
    loss = classification_loss_2p5d(par_cls(e), _blk(labels, mesh, hidden=False), mesh)
    assert_close(loss, loss_ref, TOL, f"{what} loss")
    torch.autograd.backward([loss, e], [torch.ones(()), _blk(GE, mesh)])
    assert_close(mine.grad, images.grad, TOL, f"{what} image grad")
    ref = nn.ModuleDict(dict(pe=ref_pe, cls=nn.Module()))
    ref.cls.weight, ref.cls.bias = ref_cls.weight, ref_cls.bias
    compare_parameters(nn.ModuleDict(dict(pe=par_pe, cls=par_cls)), ref, mesh.grid, what)
    if d == 1:                                       # the same run on the 2D layers: equal bit for bit
        m2 = mesh_2d(q)
        torch.manual_seed(seed)
        pe2, cls2 = PatchEmbedding2D(img, patch, chans, h, m2, 0.1), ClsClassifier2D(h, classes, m2, bias=True,
                                                                                    init_std=0.1)
        with torch.no_grad():
            cls2.bias.copy_(ref_cls.bias)
        mine2 = images.detach().clone().requires_grad_()
        e2 = pe2(split_batch(mine2, m2))
        loss2 = classification_loss(cls2(e2), _blk(labels, mesh, hidden=False), m2.tensor_mode, m2)
        torch.autograd.backward([loss2, e2], [torch.ones(()), _blk(GE, mesh)])
        assert torch.equal(loss2, loss) and torch.equal(e2, e) and torch.equal(mine2.grad, mine.grad), what
        pairs = list(zip(list(par_pe.parameters()) + list(par_cls.parameters()),
                         list(pe2.parameters()) + list(cls2.parameters())))
        assert all(torch.equal(a.grad, c.grad) for a, c in pairs), f"{what}: d=1 grads differ from 2D"
    return True


@pytest.mark.wide
@pytest.mark.parametrize("d", [1, 2])
def test_vit_path(d):
    assert all(run_on_ranks(4 * d, _vit_path, 2, d, 8, 8, 4, 3, 8, 5, fresh_seed()))
