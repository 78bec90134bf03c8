"""2D (SUMMA) layers against plain single-process PyTorch on the same global weights.

q = 2 (several shapes) and q = 3 (one tiny shape), fresh random inputs, fp32,
relative error ≤ 1e-5: forward output, input gradient and every parameter gradient
of Linear2D (with and without bias), RMSNorm2D, LayerNorm2D, VocabParallelEmbedding2D,
Embedding2D, the vocab-parallel LM head (untied and tied) with the 2D cross-entropy
(padded vocabulary, ignored targets), Classifier2D and PatchEmbedding2D. Linear2D's
ledger equals gridshard.tensor.tp2d.theory exactly, its parameters are 1/q² of the layer
and its saved activations 1/q² of one device's (measured with saved_tensors_hooks). Under bf16
autocast Linear2D returns F.linear's dtype (bf16), its bias added in that dtype.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gridshard.comm import LEDGER
from gridshard.comm.grid_ops import gather_along, reduce_scatter_along, split_batch
from gridshard.tensor.tp2d.classifier import Classifier2D, TiedVocabHead2D, VocabParallelClassifier2D
from gridshard.tensor.tp2d.cross_entropy import cross_entropy_2d
from gridshard.tensor.tp2d.embedding import Embedding2D, VocabParallelEmbedding2D
from gridshard.tensor.tp2d.linear import Linear2D
from gridshard.tensor.tp2d.norm import LayerNorm2D, RMSNorm2D
from gridshard.tensor.tp2d.patch_embedding import PatchEmbedding2D
from gridshard.testing.plain import plain_embedding, plain_lm_head, plain_linear
from gridshard.parallel import ParallelContext
from gridshard.testing import assert_close, run_on_ranks
from gridshard.tensor.tp2d import theory as tp2d

from .test_tp2d_helpers import (TOL, SavedActivations, block, compare_parameters, expected_shard, fresh_seed,
                                ledger_matches, mesh_2d, pad_to, randint, randn)


def _set_bias(par, ref, n, mesh):
    """A non-zero bias, so the bias path is really exercised."""
    with torch.no_grad():
        full = torch.linspace(-1, 1, n)
        ref.bias.copy_(full)
        par.bias.copy_(expected_shard(full, par.bias.shard_spec, mesh))


# ---- Linear2D -----------------------------------------------------------------------------------------------
def _linear(q, cases, seed):
    mesh = mesh_2d(q)
    for k, (b, s, fin, fout, bias) in enumerate(cases):
        what = f"Linear2D q={q} b,s,in,out={b},{s},{fin},{fout} bias={bias} seed={seed}"
        torch.manual_seed(seed + k)
        ref = plain_linear(fin, fout, bias, 0.05)
        torch.manual_seed(seed + k)
        par = Linear2D(fin, fout, mesh, bias=bias, init_std=0.05)
        if bias:
            _set_bias(par, ref, fout, mesh)
        X = randn((b, s, fin), seed + 100 + k).requires_grad_()
        G = randn((b, s, fout), seed + 200 + k)
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
        ledger_matches(tp2d.linear2d_comm(b * s, fin, fout, q, 4, bias=bias), what)
        assert tp2d.rounds(tp2d.linear2d_comm(b * s, fin, fout, q, 4, bias=bias)) == (2 * q + 4 + 2 * bias if q > 1 else 0)
        nbytes = sum(p.numel() * p.element_size() for p in par.parameters())
        assert nbytes == tp2d.linear2d_param_bytes(fin, fout, q, 4, bias), what
        assert nbytes * q * q == sum(p.numel() * 4 for p in ref.parameters()), what
        assert saved_par.nbytes == tp2d.linear2d_saved_activation_bytes(b * s, fin, q, 4), what
        # the exact formula is asserted just above; the 1.1 bound restates it against the one-device
        # measurement (equal here) with room for a small saved statistic, while 1/q (no 2D saving) fails
        assert saved_par.nbytes <= 1.1 * saved_ref.nbytes / q ** 2, f"{what}: saved {saved_par.nbytes} B"
    return True


def test_linear2d_q2():
    cases = [(2, 3, 8, 12, True), (2, 3, 8, 24, True), (4, 5, 12, 16, False), (2, 1, 4, 8, False)]
    assert all(run_on_ranks(4, _linear, 2, cases, fresh_seed()))


def _linear_autocast(q, seed):
    """Under bf16 autocast Linear2D returns what F.linear returns there: a bf16 output (its bias
    added in the product's dtype, not promoting it to fp32), close to the one-device product."""
    mesh = mesh_2d(q)
    torch.manual_seed(seed)
    ref = plain_linear(8, 12, True, 0.05)
    torch.manual_seed(seed)
    par = Linear2D(8, 12, mesh, bias=True, init_std=0.05)
    _set_bias(par, ref, 12, mesh)
    X = randn((2, 3, 8), seed + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Y = ref(X)
        y = par(block(X, mesh))
    assert Y.dtype == torch.bfloat16 and y.dtype == Y.dtype, (Y.dtype, y.dtype)
    assert_close(y.float(), block(Y.float(), mesh), 3e-2, f"Linear2D autocast q={q} seed={seed}")
    return True


def test_linear2d_under_bf16_autocast_keeps_the_product_dtype():
    assert all(run_on_ranks(4, _linear_autocast, 2, fresh_seed()))


def test_linear2d_q3():
    assert all(run_on_ranks(9, _linear, 3, [(3, 2, 9, 18, True)], fresh_seed()))


# ---- gathered vectors: once per cache window (one optimizer step) ------------------------------------------
def _vector_cache(q, seed):
    """Linear2D (bias) → RMSNorm2D over three SGD steps against the same plain modules, each
    step's forwards inside one ``GatheredVectors`` window: every forward, gradient and updated
    parameter matches; the bias and norm weight are all-gathered in the first forward of a
    window only (a second forward in it gathers nothing); outside a window every forward
    gathers, so a write the optimizer does not make (through ``.data``) is seen at once."""
    from gridshard.comm.grid_ops import GatheredVectors

    mesh = mesh_2d(q)
    b, s, fin, fout = 2 * q, 3, 4 * q, 4 * q * q
    what = f"vector cache q={q} seed={seed}"
    torch.manual_seed(seed)
    ref_lin = plain_linear(fin, fout, True, 0.05)
    cache = GatheredVectors()
    torch.manual_seed(seed)
    par_lin = Linear2D(fin, fout, mesh, bias=True, init_std=0.05, vector_cache=cache)
    _set_bias(par_lin, ref_lin, fout, mesh)
    ref_norm, par_norm = nn.RMSNorm(fout, eps=1e-5), RMSNorm2D(fout, mesh, eps=1e-5, vector_cache=cache)
    with torch.no_grad():
        ref_norm.weight.copy_(randn((fout,), seed + 1) * 0.5 + 1)
        par_norm.weight.copy_(expected_shard(ref_norm.weight, par_norm.weight.shard_spec, mesh))
    ref, par = nn.Sequential(ref_lin, ref_norm), nn.Sequential(par_lin, par_norm)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_par = torch.optim.SGD(par.parameters(), lr=0.5)
    gathers = lambda: sum(e.count for (op, axis), e in LEDGER.entries.items()
                          if op == "all_gather" and axis == "col")
    for step in range(3):
        X = randn((b, s, fin), seed + 10 + step)
        G = randn((b, s, fout), seed + 20 + step)
        opt_ref.zero_grad()
        opt_par.zero_grad()
        ref(X).backward(G)
        with cache.window():
            for repeat in range(2):                 # two forwards in one step: micro-batches
                LEDGER.reset()
                y = par(block(X, mesh))
                assert_close(y, block(ref(X), mesh), TOL, f"{what} step {step} forward {repeat}")
                # q > 1: one gather per vector (bias, norm weight) in the first forward of a window
                assert gathers() == (2 if repeat == 0 and q > 1 else 0), f"{what} step {step}: {gathers()} gathers"
                if repeat == 0:
                    y.backward(block(G, mesh))
        compare_parameters(par, ref, mesh, f"{what} step {step}")
        opt_ref.step()
        opt_par.step()
    with torch.no_grad():                          # a write the optimizer does not make
        ref_norm.weight.mul_(2.0)
        par_norm.weight.data.mul_(2.0)
    X = randn((b, s, fin), seed + 30)
    for repeat in range(2):                        # outside a window: gathered on every forward
        LEDGER.reset()
        assert_close(par(block(X, mesh)), block(ref(X), mesh), TOL, f"{what} after a .data write")
        assert gathers() == (2 if q > 1 else 0), f"{what}: {gathers()} gathers outside a window"
    try:
        with cache.window(), cache.window():
            pass
        raise AssertionError(f"{what}: nested windows were accepted")
    except RuntimeError as e:
        assert "do not nest" in str(e), e
    assert not cache.open
    return True


def test_vector_cache_q2():
    assert all(run_on_ranks(4, _vector_cache, 2, fresh_seed()))


def _trainer_windows():
    """In ``gridshard train`` every training forward of a 2D layer runs inside the model's
    ``GatheredVectors`` window (one per optimizer step: its micro-batches share the gathered
    vectors) and the validation forwards outside one; each step's window gathers every 2D
    vector once however many micro-batches it has."""
    from gridshard.engine import Trainer

    cfg = {"model": {"preset": "tiny"},
           "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000, "val_fraction": 0.1},
           "parallel": {"data": 1, "tensor": 4, "tensor_mode": "2d"},
           "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "lr": 1e-3, "warmup_steps": 1,
                     "log_interval": 1, "eval_interval": 1, "eval_batches": 1}}
    trainer = Trainer(cfg, progress=False)
    cache = trainer.context.vector_cache
    norms = [m for m in trainer.model.modules() if isinstance(m, RMSNorm2D)]
    assert norms and all(m.vector_cache is cache for m in norms)
    seen = []
    norms[0].register_forward_pre_hook(lambda m, args: seen.append((torch.is_grad_enabled(), cache.open)))
    gathered = []
    lookup = cache.lookup
    cache.lookup = lambda shard: gathered.append(lookup(shard) is None) or lookup(shard)
    trainer.run()
    training = [opened for grad, opened in seen if grad]
    evaluation = [opened for grad, opened in seen if not grad]
    assert len(training) == 2 * 4 and all(training), seen          # 2 steps × 4 micro-batches, in a window
    assert evaluation and not any(evaluation), seen                 # validation: no window
    # (lookups outside a window always miss and are not recorded: ``lookup`` is only asked in one)
    n_vectors = len(gathered) // 8                                  # lookups per training micro-batch
    assert n_vectors > 0 and len(gathered) == 8 * n_vectors, len(gathered)
    assert sum(gathered) == 2 * n_vectors, (n_vectors, sum(gathered))   # gathered once per step
    return True


def test_trainer_gathers_vectors_once_per_step():
    assert all(run_on_ranks(4, _trainer_windows, timeout=300))


# ---- norms --------------------------------------------------------------------------------------------------
def _norms(q, shapes, seed):
    mesh = mesh_2d(q)
    for k, (b, s, h) in enumerate(shapes):
        for kind in ("rms", "layer"):
            what = f"{kind}norm2d q={q} b,s,h={b},{s},{h} seed={seed}"
            ref = nn.RMSNorm(h, eps=1e-5) if kind == "rms" else nn.LayerNorm(h, eps=1e-5)
            par = (RMSNorm2D if kind == "rms" else LayerNorm2D)(h, mesh, eps=1e-5)
            with torch.no_grad():  # non-trivial affine parameters
                for name, p in ref.named_parameters():
                    p.copy_(randn((h,), seed + 7 + len(name)) * 0.5 + (1.0 if name == "weight" else 0.0))
                    getattr(par, name).copy_(expected_shard(p, getattr(par, name).shard_spec, mesh))
            X = (randn((b, s, h), seed + 10 + k) * 3 + 1).requires_grad_()
            G = randn((b, s, h), seed + 20 + k)
            Y = ref(X)
            Y.backward(G)
            x = block(X, mesh).requires_grad_()
            LEDGER.reset()
            y = par(x)
            assert_close(y, block(Y, mesh), TOL, f"{what} forward")
            y.backward(block(G, mesh))
            assert_close(x.grad, block(X.grad, mesh), TOL, f"{what} input grad")
            compare_parameters(par, ref, mesh, what)
            if kind == "rms":
                ledger_matches(tp2d.rmsnorm2d_comm(b * s, h, q), what)
            else:
                ledger_matches(tp2d.layernorm2d_comm(b * s, h, q), what)
    return True


def test_norms_q2():
    assert all(run_on_ranks(4, _norms, 2, [(2, 3, 8), (4, 2, 12)], fresh_seed()))


# ---- embeddings ---------------------------------------------------------------------------------------------
def _embeddings(q, b, s, vocab, h, seed):
    mesh = mesh_2d(q)
    what = f"VocabParallelEmbedding2D q={q} b,s,V,h={b},{s},{vocab},{h} seed={seed}"
    torch.manual_seed(seed)
    ref = plain_embedding(vocab, h, 0.1)
    torch.manual_seed(seed)
    par = VocabParallelEmbedding2D(vocab, h, mesh, 0.1)
    tokens = randint(vocab, (b, s), seed + 1)
    tokens[0, 0], tokens[-1, -1] = 0, vocab - 1       # both ends of the vocabulary
    G = randn((b, s, h), seed + 2)
    Y = ref(tokens)
    Y.backward(G)
    LEDGER.reset()
    y = par(block(tokens, mesh, last=False))
    assert_close(y, block(Y, mesh), TOL, f"{what} forward")
    y.backward(block(G, mesh))
    compare_parameters(par, ref, mesh, what)
    ledger_matches(tp2d.embedding2d_comm(b, s, h, q), what)

    what = f"Embedding2D q={q} b,s,V,h={b},{s},{vocab},{h * q} seed={seed}"
    torch.manual_seed(seed)
    ref = plain_embedding(vocab, h * q, 0.1)
    torch.manual_seed(seed)
    par = Embedding2D(vocab, h * q, mesh, 0.1)
    G = randn((b, s, h * q), seed + 3)
    Y = ref(tokens)
    Y.backward(G)
    y = par(block(tokens, mesh, last=False))
    assert_close(y, block(Y, mesh), TOL, f"{what} forward")
    y.backward(block(G, mesh))
    compare_parameters(par, ref, mesh, what)
    return True


def test_embeddings_q2_vocab_not_divisible():
    assert all(run_on_ranks(4, _embeddings, 2, 4, 3, 13, 8, fresh_seed()))


# ---- LM head + cross-entropy ----------------------------------------------------------------------------------
def _head_and_loss(q, b, s, vocab, h, tied, seed):
    mesh = mesh_2d(q)
    what = f"LM head tied={tied} + cross_entropy_2d q={q} b,s,V,h={b},{s},{vocab},{h} seed={seed}"
    torch.manual_seed(seed)
    ref_emb = plain_embedding(vocab, h, 0.1)
    ref_head = plain_lm_head(h, vocab, 0.1, tied=ref_emb if tied else None)
    torch.manual_seed(seed)
    par_emb = VocabParallelEmbedding2D(vocab, h, mesh, 0.1)
    par_head = TiedVocabHead2D(par_emb) if tied else VocabParallelClassifier2D(h, vocab, mesh, 0.1)
    ref, par = nn.ModuleDict(dict(emb=ref_emb, head=ref_head)), nn.ModuleDict(dict(emb=par_emb, head=par_head))
    tokens, targets = randint(vocab, (b, s), seed + 1), randint(vocab, (b, s), seed + 2)
    targets[0, :2] = -100                          # ignored positions
    targets[-1, -1] = vocab - 1                    # the last real column, next to the padding
    X = randn((b, s, h), seed + 3).requires_grad_()
    Z = ref_head(ref_emb(tokens) + X)
    loss_ref = ParallelContext(None, "none", False, vocab).loss(Z, targets)
    loss_ref.backward()
    x = block(X, mesh).requires_grad_()
    z = par_head(par_emb(block(tokens, mesh, last=False)) + x)
    vp = par_emb.padded_vocab
    assert_close(z, block(pad_to(Z.detach(), (b, s, vp)), mesh), TOL, f"{what} logits")
    loss = cross_entropy_2d(z, block(targets, mesh, last=False), mesh, vocab)
    assert_close(loss, loss_ref, TOL, f"{what} loss")
    loss.backward()
    assert_close(x.grad, block(X.grad, mesh), TOL, f"{what} input grad")
    compare_parameters(par, ref, mesh, what)
    return float(loss.detach())


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_and_cross_entropy_q2(tied):
    losses = run_on_ranks(4, _head_and_loss, 2, 4, 3, 11, 8, tied, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def test_lm_head_and_cross_entropy_q3():
    losses = run_on_ranks(9, _head_and_loss, 3, 3, 2, 7, 9, True, fresh_seed())
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


# ---- Classifier2D and PatchEmbedding2D (the ViT path) ---------------------------------------------------------
class _PlainPatchEmbedding(nn.Module):
    """Single-device reference: conv patches + class token + positions, drawn in PatchEmbedding2D's order."""

    def __init__(self, img, patch, chans, hidden, std):
        super().__init__()
        n = (img // patch) ** 2
        self.weight = nn.Parameter(torch.empty(hidden, chans, patch, patch).normal_(0, std))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.cls_token = nn.Parameter(torch.empty(1, 1, hidden).normal_(0, std))
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + n, hidden).normal_(0, std))
        self.patch = patch

    def forward(self, images):
        y = F.conv2d(images, self.weight, self.bias, stride=self.patch).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(y.shape[0], -1, -1), y], 1) + self.pos_embed


def _vit_path(q, b, img, patch, chans, h, classes, seed):
    mesh = mesh_2d(q)
    what = f"PatchEmbedding2D→Classifier2D q={q} b={b} img={img} patch={patch} h={h} C={classes} seed={seed}"
    torch.manual_seed(seed)
    ref_pe = _PlainPatchEmbedding(img, patch, chans, h, 0.1)
    ref_cls = plain_linear(h, classes, True, 0.1)
    torch.manual_seed(seed)
    par_pe = PatchEmbedding2D(img, patch, chans, h, mesh, 0.1)
    par_cls = Classifier2D(h, classes, mesh, bias=True, init_std=0.1)
    _set_bias(par_cls, ref_cls, classes, mesh)
    with torch.no_grad():
        ref_pe.bias.copy_(torch.linspace(-1, 1, h))
        par_pe.bias.copy_(expected_shard(ref_pe.bias, par_pe.bias.shard_spec, mesh))
    ref = nn.ModuleDict(dict(pe=ref_pe, cls=ref_cls))
    par = nn.ModuleDict(dict(pe=par_pe, cls=par_cls))
    images = randn((b, chans, img, img), seed + 1).requires_grad_()
    E = ref_pe(images)
    logits_ref = ref_cls(E[:, 0])
    G = randn(logits_ref.shape, seed + 2)
    GE = randn(E.shape, seed + 3)                   # also a gradient straight into the embeddings
    torch.autograd.backward([logits_ref, E], [G, GE])
    mine = images.detach().clone().requires_grad_()
    e = par_pe(split_batch(mine, mesh))
    assert_close(e, block(E, mesh), TOL, f"{what} patch embeddings")
    logits = par_cls(e[:, 0])
    assert_close(logits, block(logits_ref, mesh, last=False), TOL, f"{what} logits")
    torch.autograd.backward([logits, e], [block(G, mesh, last=False), block(GE, mesh)])
    assert_close(mine.grad, images.grad, TOL, f"{what} image grad (split_batch backward)")
    compare_parameters(par, ref, mesh, what)
    return True


def test_vit_path_q2():
    assert all(run_on_ranks(4, _vit_path, 2, 4, 8, 4, 3, 8, 5, fresh_seed()))


# ---- grid collectives against their definitions ----------------------------------------------------------------
def _grid_ops(seed):
    """Forward and backward of each grid collective, on per-rank inputs xs[r] and upstream gradients gs[r]."""
    mesh = mesh_2d(2)
    col = mesh.col
    r = mesh.tensor.rank
    rank_of = lambda i, j: i * 2 + j  # noqa: E731 - (grid_row, grid_col) → tensor rank, for the reference only
    xs = [randn((4, 6), seed + k) for k in range(4)]
    gs = {name: [randn(shape, seed + 10 * n + k) for k in range(4)]
          for n, (name, shape) in enumerate([("gather", (8, 6)), ("rs", (2, 6))])}
    same_col = [rank_of(i, mesh.grid_col) for i in range(2)]
    cases = [
        ("gather", lambda x: gather_along(x, col, 0), torch.cat([xs[k] for k in same_col], 0),
         sum(gs["gather"][k] for k in same_col).chunk(2, 0)[mesh.grid_row]),
        ("rs", lambda x: reduce_scatter_along(x, col, 0), sum(xs[k] for k in same_col).chunk(2, 0)[mesh.grid_row],
         torch.cat([gs["rs"][k] for k in same_col], 0)),
    ]
    for name, fn, expect_y, expect_g in cases:
        x = xs[r].clone().requires_grad_()
        y = fn(x)
        y.backward(gs[name][r])
        assert_close(y, expect_y, 1e-6, f"{name} forward seed={seed}")
        assert_close(x.grad, expect_g, 1e-6, f"{name} backward seed={seed}")
    return True


def test_grid_ops_forward_and_backward():
    assert all(run_on_ranks(4, _grid_ops, fresh_seed()))
