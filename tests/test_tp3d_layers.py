"""3D layers against plain single-process PyTorch on the same global weights.

q = 2 on 8 ranks (one worker pool, shared by every case), fresh random inputs, fp32, relative
error ≤ 1e-5: forward output, input gradient and every parameter gradient of the
Linear3D → RMSNorm3D → Linear3D chain (two accumulated micro-batches, the norm and second linear on
the swapped mesh), LayerNorm3D and Linear3D without input gradient on both orientations, the
vocabulary-parallel embedding → head → cross_entropy_3d (padded vocabulary, masked targets with
a whole batch block masked, logits up to 1e4, mean and sum); the ledger equals
gridshard.tensor.tp3d.theory exactly for each; parameters and the saved input are 1/q³ of one device's;
a bad token or target in any batch block raises the same error on all ranks; the ViT path
(PatchEmbedding3D → Linear3D → LayerNorm3D → ClsClassifier3D → classification_loss_3d, masked labels,
both orientations, ledger = theory, the image gradient). `make test` runs only the checks without
ranks; the 8-rank cases are marked wide (`make test-all`).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gridshard.comm import LEDGER
from gridshard.tensor.tp3d.mesh import build_mesh_3d, valid_3d_sides, validate_3d
from gridshard.errors import LayoutError, ShapeError
from gridshard.tensor.tp3d.cross_entropy import cross_entropy_3d
from gridshard.tensor.tp3d.embedding import VocabParallelEmbedding3D
from gridshard.tensor.tp3d.linear import Linear3D, VocabParallelClassifier3D
from gridshard.tensor.tp3d.norm import LayerNorm3D, RMSNorm3D
from gridshard.nn.sharding import take_shard
from gridshard.testing import assert_close, run_on_ranks
from gridshard.testing.plain import plain_embedding, plain_lm_head, plain_linear
from gridshard.tensor.tp3d import theory as tp3d

from .test_tp2d_helpers import TOL, SavedActivations, fresh_seed, pad_to, randint, randn

Q = 2


def _blk(t, mesh, hidden=True):
    """My block in ``mesh``'s activation layout, with its own storage."""
    return mesh.batch_block(t.detach(), hidden=hidden).clone(memory_format=torch.contiguous_format)


def _shard(ref, spec, mesh):
    ref = ref.detach()
    if spec.transposed:
        ref = ref.t()
    return take_shard(pad_to(ref, spec.global_shape), spec, mesh.coords(), mesh.sizes())


def _compare_parameters(par, ref, mesh, what):
    refs = dict(ref.named_parameters())
    assert sorted(n for n, _ in par.named_parameters()) == sorted(refs), what
    for name, p in par.named_parameters():
        assert_close(p, _shard(refs[name], p.shard_spec, mesh), TOL, f"{what} {name} value")
        assert p.grad is not None, f"{what}: {name} got no gradient"
        assert_close(p.grad, _shard(refs[name].grad, p.shard_spec, mesh), TOL, f"{what} {name} grad")


def _ledger_matches(vol, what):
    seen = {(op, axis): (e.count, e.payload_bytes) for (op, axis), e in LEDGER.entries.items() if e.count}
    expect = {(op, axis): (v.calls[op], v.payload[op]) for axis, v in vol.items() for op in v.calls}
    assert seen == expect, f"{what}: ledger {sorted(seen.items())} != theory {sorted(expect.items())}"


def _set_vector(par_p, ref_p, mesh, base, seed):
    with torch.no_grad():
        ref_p.copy_(randn(ref_p.shape, seed) * 0.5 + base)
        par_p.copy_(_shard(ref_p, par_p.shard_spec, mesh))


# ---- linear → RMSNorm → linear over two accumulated micro-batches ----------------------------------------------
def _chain(q, b, s, fin, fmid, fout, seed):
    """The block returns to the layout it started from; gradients accumulate exactly; the ledger of
    one micro-batch equals the theory; parameters and the first linear's saved input are 1/q³."""
    mesh = build_mesh_3d(q)
    out = mesh.swapped()
    what = f"Linear3D→RMSNorm3D→Linear3D q={q} b,s={b},{s} {fin}→{fmid}→{fout} seed={seed} {mesh}"
    torch.manual_seed(seed)
    ref = nn.Sequential(plain_linear(fin, fmid, True, 0.1), nn.RMSNorm(fmid, eps=1e-5),
                        plain_linear(fmid, fout, False, 0.1))
    torch.manual_seed(seed)
    par = nn.Sequential(Linear3D(fin, fmid, mesh, bias=True, init_std=0.1), RMSNorm3D(fmid, out, eps=1e-5),
                        Linear3D(fmid, fout, out, bias=False, init_std=0.1))
    _set_vector(par[0].bias, ref[0].bias, mesh, 0.0, seed + 1)
    _set_vector(par[1].weight, ref[1].weight, mesh, 1.0, seed + 2)
    n = b * s
    for micro in range(2):
        X = randn((b, s, fin), seed + 10 + micro).requires_grad_()
        G = randn((b, s, fout), seed + 20 + micro)
        with SavedActivations(ref[0]) as saved_ref:
            H = ref[0](X)
        Y = ref[2](ref[1](H))
        Y.backward(G)
        x = _blk(X, mesh).requires_grad_()
        LEDGER.reset()
        with SavedActivations(par[0]) as saved_par:
            h = par[0](x)
        assert_close(h, _blk(H, out), TOL, f"{what} micro-batch {micro} first linear (swapped layout)")
        y = par[2](par[1](h))
        assert_close(y, _blk(Y, mesh), TOL, f"{what} micro-batch {micro} forward")
        y.backward(_blk(G, mesh))
        assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} micro-batch {micro} input grad")
        _ledger_matches(tp3d.combine(tp3d.linear3d_comm(n, fin, fmid, q, bias=True),
                                     tp3d.rmsnorm3d_comm(n, fmid, q, swapped=True),
                                     tp3d.linear3d_comm(n, fmid, fout, q, swapped=True)),
                        f"{what} micro-batch {micro}")
    _compare_parameters(par, ref, mesh, f"{what} after 2 micro-batches")
    assert saved_par.nbytes == tp3d.linear3d_saved_activation_bytes(n, fin, q), (what, saved_par.nbytes)
    assert saved_par.nbytes * q ** 3 == saved_ref.nbytes, (what, saved_par.nbytes, saved_ref.nbytes)
    nbytes = sum(p.numel() * 4 for p in par[0].parameters())
    assert nbytes == tp3d.linear3d_param_bytes(fin, fmid, q, 4, bias=True), what
    assert nbytes * q ** 3 == sum(p.numel() * 4 for p in ref[0].parameters()), what
    return True


# ---- LayerNorm3D and a weight-only Linear3D on both orientations -------------------------------------------------
def _layernorm_and_frozen_input(q, b, s, h, f, seed):
    """LayerNorm3D (weight and bias) then a Linear3D whose input needs no gradient (no dX
    reduce-scatter, no W gather in backward), on the plain and the swapped mesh."""
    base = build_mesh_3d(q)
    for swapped, mesh in ((False, base), (True, base.swapped())):
        what = f"LayerNorm3D / Linear3D(no dX) q={q} swapped={swapped} seed={seed} {mesh}"
        torch.manual_seed(seed)
        ref_norm, ref_lin = nn.LayerNorm(h, eps=1e-5), plain_linear(h, f, False, 0.2)
        torch.manual_seed(seed)
        norm, lin = LayerNorm3D(h, mesh, eps=1e-5), Linear3D(h, f, mesh, bias=False, init_std=0.2)
        _set_vector(norm.weight, ref_norm.weight, mesh, 1.0, seed + 1)
        _set_vector(norm.bias, ref_norm.bias, mesh, 0.0, seed + 2)
        X = (randn((b, s, h), seed + 3) * 3 + 1).requires_grad_()
        G, G2 = randn((b, s, h), seed + 4), randn((b, s, f), seed + 5)
        Y = ref_norm(X)
        (Y * G).sum().backward()
        Z = ref_lin(X.detach())
        Z.backward(G2)
        x = _blk(X, mesh).requires_grad_()
        LEDGER.reset()
        y = norm(x)
        y.backward(_blk(G, mesh))
        _ledger_matches(tp3d.layernorm3d_comm(b * s, h, q, swapped=swapped), what + " norm ledger")
        assert_close(y, _blk(Y, mesh), TOL, f"{what} norm forward")
        assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} norm input grad")
        _compare_parameters(norm, ref_norm, mesh, what + " norm")
        LEDGER.reset()
        z = lin(_blk(X, mesh))
        z.backward(_blk(G2, mesh.swapped()))
        _ledger_matches(tp3d.linear3d_comm(b * s, h, f, q, input_grad=False, swapped=swapped), what + " linear ledger")
        assert_close(z, _blk(Z, mesh.swapped()), TOL, f"{what} linear forward")
        _compare_parameters(lin, ref_lin, mesh, what + " linear")
    return True


# ---- q|k|v as one product of the joined weight blocks (the shared input) ------------------------------------------
class _Readers(nn.Module):
    """Layers that all read the parent's one input (attention's q, k, v; the MLP's gate, up)."""

    def __init__(self, layers):
        super().__init__()
        self.names = tuple(f"part{k}" for k in range(len(layers)))
        for name, layer in zip(self.names, layers):
            setattr(self, name, layer)

    def forward(self, x):
        return [getattr(self, name)(x) for name in self.names]


def _shared_input(q, b, s, h, outs, bias, swapped, seed):
    """Linear3D parts read one input through ``install_shared_input``: outputs, the input gradient and
    every parameter gradient equal separate plain linears'; the ledger equals one Linear3D of width
    Σ out (the input gathered once: the closed-form minimum ``linear3d_wire_bytes(N, h, Σ out)``) plus
    each part's bias vector, and autograd keeps the one input block."""
    from gridshard.job_layout import TensorMode
    from gridshard.parallel.shared_input import install_shared_input
    from gridshard.theory import CommVolume

    base = build_mesh_3d(q)
    mesh = base.swapped() if swapped else base
    what = f"joined Linear3D h={h} outs={outs} bias={bias} {mesh} seed={seed}"
    torch.manual_seed(seed)
    ref = _Readers([plain_linear(h, o, bias, 0.1) for o in outs])
    torch.manual_seed(seed)
    par = _Readers([Linear3D(h, o, mesh, bias=bias, init_std=0.1) for o in outs])
    if bias:
        for k, name in enumerate(par.names):
            _set_vector(getattr(par, name).bias, getattr(ref, name).bias, mesh, 0.0, seed + 1 + k)
    install_shared_input(par, par.names, TensorMode.THREE_D)
    X = randn((b, s, h), seed + 10).requires_grad_()
    Gs = [randn((b, s, o), seed + 20 + k) for k, o in enumerate(outs)]
    Ys = ref(X)
    torch.autograd.backward(Ys, Gs)
    x = _blk(X, mesh).requires_grad_()
    LEDGER.reset()
    with SavedActivations(par) as saved:
        ys = par(x)
    out = mesh.swapped()
    for k, (y, Y) in enumerate(zip(ys, Ys)):
        assert_close(y, _blk(Y, out), TOL, f"{what} part {k} forward")
    torch.autograd.backward(ys, [_blk(G, out) for G in Gs])
    assert_close(x.grad, _blk(X.grad, mesh), TOL, f"{what} input grad")
    _compare_parameters(par, ref, mesh, what)
    n, e = b * s, 4
    vol = tp3d.linear3d_comm(n, h, sum(outs), q, swapped=swapped)
    biases = []
    for o in outs if bias else ():                   # each part's own bias vector, on its output layout's batch axis
        v = {a: CommVolume(q * q if "_" in a else q) for a in tp3d.AXES}
        v[tp3d.roles(not swapped)["batch"]].add("all_gather", o // q * e).add("reduce_scatter", o // q * e)
        biases.append(v)
    _ledger_matches(tp3d.combine(vol, *biases), what)
    assert tp3d.wire_bytes(vol) == pytest.approx(tp3d.linear3d_wire_bytes(n, h, sum(outs), q)), what
    separate = tp3d.combine(*[tp3d.linear3d_comm(n, h, o, q, swapped=swapped) for o in outs])
    saved_input = (len(outs) - 1) * 3 * n * h // q ** 2 * e         # Σ over the extra parts: 2 gathers, 1 scatter
    assert sum(separate[a].payload_bytes() - vol[a].payload_bytes() for a in tp3d.AXES) == saved_input, what
    # the one input block and nothing else: a joined weight block kept for backward would add its bytes here
    assert saved.nbytes == tp3d.linear3d_saved_activation_bytes(n, h, q), (what, saved.nbytes)
    return True


# ---- embedding → head → loss ------------------------------------------------------------------------------------
def _lm_path(q, b, s, h, vocab, scale, reduction, seed):
    """Vocabulary-parallel embedding (V padded to q²) → ×scale → head (V padded to q) →
    cross_entropy_3d with masked targets (batch block 1 wholly masked): loss, embedding and head
    gradients equal one process's; ledger = theory."""
    mesh = build_mesh_3d(q)
    what = f"embedding→head→loss q={q} V={vocab} scale={scale} {reduction} seed={seed} {mesh}"
    torch.manual_seed(seed)
    ref_emb, ref_head = plain_embedding(vocab, h, 1.0), plain_lm_head(h, vocab, 1.0)
    torch.manual_seed(seed)
    emb, head = VocabParallelEmbedding3D(vocab, h, mesh, init_std=1.0), VocabParallelClassifier3D(h, vocab, mesh, 1.0)
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[b // q ** 2: 2 * b // q ** 2] = -100            # batch block 1: every target masked
    targets[0, 0] = -100
    ref_loss = F.cross_entropy(ref_head(ref_emb(tokens) * scale).reshape(-1, vocab), targets.reshape(-1),
                               reduction=reduction)
    ref_loss.backward()
    LEDGER.reset()
    logits = head(emb(_blk(tokens, mesh, hidden=False)) * scale)
    loss = cross_entropy_3d(logits, _blk(targets, head.out_mesh, hidden=False), head.out_mesh, vocab,
                            reduction=reduction)
    loss.backward()
    assert logits.abs().max() > 0.3 * scale, (what, float(logits.abs().max()))
    assert_close(loss.detach().reshape(1), ref_loss.detach().reshape(1), TOL, f"{what} loss")
    n = b * s
    _ledger_matches(tp3d.combine(tp3d.embedding3d_comm(b, s, h, q), tp3d.head3d_comm(n, h, vocab, q),
                                 tp3d.cross_entropy3d_comm(n, q, swapped=True)), what)
    _compare_parameters(emb, ref_emb, mesh, what + " embedding")
    _compare_parameters(head, ref_head, mesh, what + " head")
    return True


def _bad_ids(q, which, block, seed):
    """A bad token (or target) in batch block ``block`` raises the same ShapeError on every rank."""
    mesh = build_mesh_3d(q)
    b, s, h, vocab = 2 * q * q, 3, 4 * q, 11
    tokens, targets = randint(vocab, (b, s), seed), randint(vocab, (b, s), seed + 1)
    bad = tokens if which == "token" else targets
    bad[block * b // q ** 2, 1] = vocab + 5
    emb, head = VocabParallelEmbedding3D(vocab, h, mesh), VocabParallelClassifier3D(h, vocab, mesh)
    try:
        logits = head(emb(_blk(tokens, mesh, hidden=False)))
        cross_entropy_3d(logits, _blk(targets, head.out_mesh, hidden=False), head.out_mesh, vocab)
    except ShapeError as err:
        return str(err)
    return "no error"


@pytest.mark.wide                     # 8 ranks; make test-all runs it
def test_linear_norm_chain_two_micro_batches():
    assert all(run_on_ranks(8, _chain, Q, 8, 3, 8, 16, 12, fresh_seed()))


@pytest.mark.wide
def test_layernorm_and_linear_without_input_grad_both_orientations():
    assert all(run_on_ranks(8, _layernorm_and_frozen_input, Q, 4, 5, 16, 8, fresh_seed()))


@pytest.mark.wide
@pytest.mark.parametrize("outs,bias,swapped", [((16, 8, 8), False, False), ((24, 24), True, True)])
def test_shared_input_parts_gather_the_input_once(outs, bias, swapped):
    assert all(run_on_ranks(8, _shared_input, Q, 4, 3, 16, outs, bias, swapped, fresh_seed()))


@pytest.mark.wide
@pytest.mark.parametrize("scale,reduction", [(1.0, "mean"), (1e4, "mean"), (1.0, "sum")])
def test_embedding_head_loss(scale, reduction):
    assert all(run_on_ranks(8, _lm_path, Q, 8, 3, 8, 13, scale, reduction, fresh_seed()))


@pytest.mark.wide
@pytest.mark.parametrize("which,block", [("token", 0), ("token", 3), ("target", 2)])
def test_bad_id_in_any_batch_block_raises_on_every_rank(which, block):
    msgs = run_on_ranks(8, _bad_ids, Q, which, block, fresh_seed())
    assert len(set(msgs)) == 1 and f"batch block {block}" in msgs[0] and "Fix:" in msgs[0], msgs


# ---- pure checks (no ranks): make test ----------------------------------------------------------------------------
def test_layout_validation_and_theory():
    validate_3d(8, 2)
    validate_3d(27, 3)
    assert valid_3d_sides() == [8, 27, 64]
    for args, match in (((8, 3), "q³ = 27"), ((8, 1), "q=1"), ((9, 2), "no q fits 9"), ((27, 2), "q=3 fits 27")):
        with pytest.raises(LayoutError, match=match) as err:
            validate_3d(*args)
        assert "Fix:" in str(err.value)
    n, i, o, q = 54, 36, 24, 3
    lin = tp3d.linear3d_comm(n, i, o, q)
    assert tp3d.rounds(lin) == 8
    assert tp3d.wire_bytes(lin) == pytest.approx(tp3d.linear3d_wire_bytes(n, i, o, q))
    assert lin["input"].payload == {"all_gather": 2 * n * i // q ** 2 * 4, "reduce_scatter": n * i // q ** 2 * 4}
    swapped = tp3d.linear3d_comm(n, i, o, q, bias=True, swapped=True)
    assert swapped["output"].payload == lin["input"].payload and swapped["input"].payload == lin["output"].payload
    assert swapped["weight_input"].calls == {"all_gather": 1, "reduce_scatter": 1}      # the bias: output layout
    assert tp3d.linear3d_param_bytes(i, o, q) * q ** 3 == i * o * 4
    assert tp3d.linear3d_saved_activation_bytes(n, i, q) * q ** 3 == n * i * 4
    with pytest.raises(ValueError, match="in_features=10 is not divisible by 9"):
        tp3d.linear3d_comm(n, 10, o, q)


# ---- the ViT path: PatchEmbedding3D → Linear3D → LayerNorm3D → ClsClassifier3D → classification_loss_3d -----
def _vit_path_3d(q, b, img, patch, chans, h, classes, swapped, reduction, seed):
    """Patch tokens, logits, loss, the image gradient and every parameter gradient equal one
    process's (labels masked, batch block 1 wholly); the embedding on ``mesh``, the head on the
    swapped orientation after a Linear3D; ledger = theory; the embedding stores 1/q³ of its layer."""
    from gridshard.tensor.tp3d.vision import ClsClassifier3D, PatchEmbedding3D, classification_loss_3d

    from .test_tp2d_layers import _PlainPatchEmbedding

    base = build_mesh_3d(q)
    mesh = base.swapped() if swapped else base
    out = mesh.swapped()
    what = (f"PatchEmbedding3D→…→ClsClassifier3D q={q} b={b} img={img} h={h} K={classes} {reduction} "
            f"seed={seed} {mesh}")
    torch.manual_seed(seed)
    ref = nn.ModuleDict(dict(pe=_PlainPatchEmbedding(img, patch, chans, h, 0.1), lin=plain_linear(h, h, True, 0.1),
                             norm=nn.LayerNorm(h, eps=1e-5), cls=plain_linear(h, classes, True, 0.1)))
    torch.manual_seed(seed)
    par = nn.ModuleDict(dict(pe=PatchEmbedding3D(img, patch, chans, h, mesh, 0.1),
                             lin=Linear3D(h, h, mesh, bias=True, init_std=0.1), norm=LayerNorm3D(h, out, eps=1e-5),
                             cls=ClsClassifier3D(h, classes, out, bias=True, init_std=0.1)))
    _set_vector(par.pe.bias, ref.pe.bias, mesh, 0.0, seed + 1)
    _set_vector(par.lin.bias, ref.lin.bias, out, 0.0, seed + 2)
    _set_vector(par.norm.weight, ref.norm.weight, out, 1.0, seed + 3)
    _set_vector(par.norm.bias, ref.norm.bias, out, 0.0, seed + 4)
    with torch.no_grad():
        ref.cls.bias.copy_(torch.linspace(-1, 1, classes))
        par.cls.bias.copy_(ref.cls.bias)
    X = randn((b, chans, img, img), seed + 5).requires_grad_()
    labels = randint(classes, (b,), seed + 6)
    labels[b // q ** 2: 2 * b // q ** 2] = -100                # batch block 1: every label masked
    labels[0] = -100
    E = ref.pe(X)
    logits_ref = ref.cls(ref.norm(ref.lin(E))[:, 0])
    loss_ref = F.cross_entropy(logits_ref, labels, reduction=reduction)
    loss_ref.backward()
    x = _blk(X, mesh, hidden=False).requires_grad_()
    LEDGER.reset()
    e = par.pe(x)
    assert_close(e, _blk(E, mesh), TOL, f"{what} patch tokens")
    logits = par.cls(par.norm(par.lin(e)))
    assert_close(logits, _blk(logits_ref, out, hidden=False), TOL, f"{what} logits")
    loss = classification_loss_3d(logits, _blk(labels, out, hidden=False), out, reduction=reduction)
    loss.backward()
    assert_close(loss.detach().reshape(1), loss_ref.detach().reshape(1), TOL, f"{what} loss")
    assert_close(x.grad, _blk(X.grad, mesh, hidden=False), TOL, f"{what} image grad")
    s = 1 + (img // patch) ** 2
    _ledger_matches(tp3d.combine(tp3d.patch_embedding3d_comm(b, h, chans, patch, s, q, swapped=swapped,
                                                             image_grad=True),
                                 tp3d.linear3d_comm(b * s, h, h, q, bias=True, swapped=swapped),
                                 tp3d.layernorm3d_comm(b * s, h, q, swapped=not swapped),
                                 tp3d.classifier3d_comm(b, h, classes, q, swapped=not swapped),
                                 tp3d.classification_loss3d_comm(q, reduction, swapped=not swapped)), what)
    for name in ("pe", "lin", "norm", "cls"):
        _compare_parameters(par[name], ref[name], mesh, f"{what} {name}")
    nbytes = sum(p.numel() * 4 for p in par.pe.parameters())
    assert nbytes == tp3d.patch_embedding3d_param_bytes(h, chans, patch, s, q), what
    assert nbytes * q ** 3 == sum(p.numel() * 4 for p in ref.pe.parameters()), what
    try:
        par.pe(x[:, :, :-1])
    except ShapeError as err:
        assert "Fix:" in str(err) and f"[b/q², {chans}, {img}, {img}]" in str(err), str(err)
    else:
        raise AssertionError(f"{what}: a wrongly sized image gave no ShapeError")
    return True


@pytest.mark.wide
@pytest.mark.parametrize("swapped,reduction", [(False, "mean"), (True, "sum")])
def test_vit_path_3d(swapped, reduction):
    assert all(run_on_ranks(8, _vit_path_3d, Q, 8, 8, 4, 3, 16, 5, swapped, reduction, fresh_seed()))


def test_vision_3d_theory():
    """The patch embedding's traffic does not grow with the batch and is below a Linear3D over flattened
    patches (what vision_3d's docstring chooses against) once N·(K + h) > q·K·h (ViT-B/16, q = 2: above
    at 2 images, below at 8); parameters 1/q³; the classifier's and the loss's volumes."""
    q, h, chans, patch, s = 2, 768, 3, 16, 197
    k = chans * patch * patch
    pe = lambda b: tp3d.patch_embedding3d_comm(b, h, chans, patch, s, q)  # noqa: E731
    assert tp3d.wire_bytes(pe(4)) == tp3d.wire_bytes(pe(64)) and tp3d.rounds(pe(4)) == 8
    lin = lambda b: tp3d.linear3d_comm(b * (s - 1), k, h, q, bias=True, input_grad=False)  # noqa: E731
    assert tp3d.wire_bytes(lin(2)) < tp3d.wire_bytes(pe(4)) < tp3d.wire_bytes(lin(8))   # q·K·h = N·(K + h)
    assert 2 * (s - 1) * (k + h) < q * k * h < 8 * (s - 1) * (k + h)
    assert tp3d.patch_embedding3d_param_bytes(h, chans, patch, s, q) * q ** 3 == (k + 2 + s) * h * 4
    cls = tp3d.classifier3d_comm(8, 16, 5, q)
    assert cls["weight_input"].payload == {"all_gather": 5 * 16 // q * 4, "reduce_scatter": 5 * 16 // q * 4,
                                           "all_reduce": 5 * 4}
    assert cls["output"].payload == {"all_reduce": 8 // q ** 2 * 5 * 4}
    loss = tp3d.classification_loss3d_comm(q, "mean", swapped=True)
    assert loss["weight_output"].calls == {"all_reduce": 2} and loss["weight_input"].calls == {}
