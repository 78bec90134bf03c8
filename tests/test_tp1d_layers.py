"""1D tensor-parallel layers against plain single-process PyTorch on the same global weights.

For T ∈ {1, 2, 4}, with and without sequence parallelism, on fresh random inputs
and two shapes each: forward output, input gradient and every parameter gradient
of ColumnParallelLinear, RowParallelLinear, a column → row SwiGLU MLP,
VocabParallelEmbedding, vocab_parallel_cross_entropy and RMSNorm equal the
reference (fp32, relative error ≤ 1e-5), and the ledger equals gridshard.tensor.tp1d.theory.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gridshard.comm import LEDGER
from gridshard.job_layout import TensorMode
from gridshard.models import ModelConfig
from gridshard.tensor.tp1d.cross_entropy import vocab_parallel_cross_entropy
from gridshard.tensor.tp1d.embedding import VocabParallelEmbedding, padded_vocab_size
from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear
from gridshard.nn.norm import RMSNorm
from gridshard.testing.plain import plain_embedding, plain_linear
from gridshard.parallel import ParallelContext
from gridshard.testing import assert_close, run_on_ranks
from gridshard.tensor.tp1d import theory as tp1d

from .test_tp1d_helpers import (TOL, compare_parameters, expected_shard, last_dim_shard, mesh_1d, pad_to,
                                randint, randn, seq_block)

SHAPES = [(2, 8, 16), (3, 12, 24)]           # (batch, seq, hidden); seq divisible by 4 for SP


def _input(X, mesh, sp):
    """The rank's view of a residual-layout input, as a leaf that collects its gradient."""
    return (seq_block(X, mesh) if sp else X.detach().clone()).requires_grad_()


def _residual(Y, mesh, sp):
    return seq_block(Y, mesh) if sp else Y.detach()


def _check_column(mesh, sp, b, s, h, seed):
    T = mesh.tensor.size
    combos = [  # (bias, out_features, gather_output, skip_bias_add, overlap_input_grad)
        (True, 12, False, False, True), (False, 24, False, False, True), (True, 36, True, True, True),
        (True, 24, True, False, True), (True, 12, False, True, True), (True, 12, False, False, False),
        (True, 36, True, True, False)]
    for k, (bias, out, gather, skip, overlap) in enumerate(combos):
        what = f"column(bias={bias}, out={out}, gather={gather}, skip={skip}, overlap={overlap}, b,s,h={b},{s},{h})"
        torch.manual_seed(seed + k)
        ref = plain_linear(h, out, bias, 0.05)
        torch.manual_seed(seed + k)
        par = ColumnParallelLinear(h, out, mesh, bias=bias, gather_output=gather, skip_bias_add=skip,
                                   sequence_parallel=sp, init_std=0.05, overlap_input_grad=overlap)
        with torch.no_grad():   # a non-zero bias, so the bias path is really exercised
            for m in (ref, par):
                if m.bias is not None:
                    m.bias.copy_(expected_shard(torch.linspace(-1, 1, out), m.bias.shard_spec, mesh)
                                 if m is par else torch.linspace(-1, 1, out))
        X = randn((b, s, h), seed + 100 + k).requires_grad_()
        G = randn((b, s, out), seed + 200 + k)
        Y = ref(X)
        Y.backward(G)
        x = _input(X, mesh, sp)
        y = par(x)
        if skip:
            y, bb = y
            assert (bb is None) == (not bias)
            y = y if bb is None else y + bb
        expect = Y.detach() if gather else last_dim_shard(Y, mesh)
        assert_close(y, expect, TOL, f"{what} forward")
        y.backward(G if gather else last_dim_shard(G, mesh))
        assert_close(x.grad, _residual(X.grad, mesh, sp), TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh, what)
        assert par.weight.shape == (out // T, h)


def _check_input_grad_overlap(mesh, sp, b, s, h, seed):
    """A column product whose backward starts the input-gradient collective before its weight
    gradient (``column_input`` + ``column_product``) equals the two-node order
    (``copy_to_group`` / ``gather_sequence`` then ``F.linear``) with the same ledger — under SP
    plus the all-gather that re-gathers the saved sequence block in backward; and when the full
    input has a second consumer, the entry sees a gradient that is not the launched one and
    reduces the received sum instead (one extra collective, the same values)."""
    from gridshard.comm.dual_ops import copy_to_group, gather_sequence
    from gridshard.tensor.tp1d.input_grad_overlap import column_input
    from gridshard.tensor.tp1d.linear import column_product

    parts = [randn((8, h), seed + 1), randn((4, h), seed + 2)]
    X, G, C2 = randn((b, s, h), seed + 3), randn((b, s, 12), seed + 4), randn((b, s, h), seed + 5)
    for second in (False, True):
        got = {}
        for overlap in (True, False):
            x = _input(X, mesh, sp)
            w = [p.clone().requires_grad_() for p in parts]
            LEDGER.reset()
            if overlap:
                xf, handoff = column_input(x, mesh.tensor, sp)
                y = column_product(xf, w, handoff)
            else:
                xf = gather_sequence(x, mesh.tensor, 1) if sp else copy_to_group(x, mesh.tensor)
                y = F.linear(xf, torch.cat(w, 0))
            loss = (y * G).sum() + ((xf * C2).sum() if second else 0.0)
            loss.backward()
            got[overlap] = (y.detach(), x.grad, [p.grad for p in w],
                            sum(e.count for e in LEDGER.entries.values()))
        what = f"input-grad overlap sp={sp} second consumer={second} b,s,h={b},{s},{h}"
        (y1, gx1, gw1, n1), (y0, gx0, gw0, n0) = got[True], got[False]
        assert_close(y1, y0, TOL, f"{what} forward")
        assert_close(gx1, gx0, TOL, f"{what} input grad")
        for a, c in zip(gw1, gw0):
            assert_close(a, c, TOL, f"{what} weight grad")
        T = mesh.tensor.size
        assert n1 == n0 + (1 if second and T > 1 else 0) + (1 if sp and T > 1 else 0), (what, n1, n0)
    # a backward that wants only the weight gradients never reaches the entry: nothing is launched
    # but, under SP, the re-gather of the saved block that the weight gradient reads
    x = _input(X, mesh, sp)
    w = [p.clone().requires_grad_() for p in parts]
    xf, handoff = column_input(x, mesh.tensor, sp)
    y = column_product(xf, w, handoff)
    LEDGER.reset()
    grads = torch.autograd.grad((y * G).sum(), w)
    regathers = 1 if sp and mesh.tensor.size > 1 else 0
    assert sum(e.count for e in LEDGER.entries.values()) == LEDGER.count("all_gather") == regathers, \
        dict(LEDGER.entries)
    assert_close(torch.cat(grads, 0), torch.cat(gw1, 0), TOL, f"sp={sp}: weight-only backward")


def _check_column_saves_its_block(mesh, b, s, h, seed):
    """Under SP a column layer keeps only its sequence block for backward (the saved-tensor
    meter sees b·s/T·h·4 bytes besides the weight, not the gathered b·s·h·4) and re-gathers it
    in backward: one more all-gather than the forward's, and the same gradients as one process
    on the same weight — with and without the input-gradient overlap, for a sequence-first
    block (as SP activations are stored) and a batch-first one."""
    from gridshard.engine.memory_meter import SavedTensorMeter

    T, out = mesh.tensor.size, 8 * mesh.tensor.size
    X, G = randn((b, s, h), seed + 1).requires_grad_(), randn((b, s, out), seed + 2)
    for k, (overlap, seq_first) in enumerate([(True, True), (False, True), (True, False)]):
        what = f"column SP saves its block (overlap={overlap}, sequence-first={seq_first}, b,s,h={b},{s},{h})"
        torch.manual_seed(seed + k)
        ref = plain_linear(h, out, False, 0.05)
        torch.manual_seed(seed + k)
        par = ColumnParallelLinear(h, out, mesh, bias=False, sequence_parallel=True, init_std=0.05,
                                   overlap_input_grad=overlap)
        X.grad = None
        ref(X).backward(G)
        block = seq_block(X, mesh)
        x = (block.transpose(0, 1).contiguous().transpose(0, 1) if seq_first else block).requires_grad_()
        LEDGER.reset()
        with SavedTensorMeter(exclude=par.parameters()) as meter:
            y = par(x)
        assert meter.bytes == b * (s // T) * h * 4, f"{what}: saved {meter.entries}"
        gathers = LEDGER.count("all_gather")
        y.backward(last_dim_shard(G, mesh))
        assert LEDGER.count("all_gather") == 2 * gathers == 2 * (T > 1), f"{what}: {dict(LEDGER.entries)}"
        assert_close(y, last_dim_shard(ref(X).detach(), mesh), TOL, f"{what} forward")
        assert_close(x.grad, seq_block(X.grad, mesh), TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh, what)


def _check_row(mesh, sp, b, s, h, seed):
    T = mesh.tensor.size
    combos = [(True, True, False), (False, True, False), (True, True, True)]   # (bias, input_is_parallel, skip)
    if not sp:
        combos += [(True, False, True), (True, False, False)]
    n = 8 * T
    for k, (bias, parallel_in, skip) in enumerate(combos):
        what = f"row(bias={bias}, input_is_parallel={parallel_in}, skip={skip}, b,s,h={b},{s},{h})"
        torch.manual_seed(seed + k)
        ref = plain_linear(n, h, bias, 0.05)
        torch.manual_seed(seed + k)
        par = RowParallelLinear(n, h, mesh, bias=bias, input_is_parallel=parallel_in, skip_bias_add=skip,
                                sequence_parallel=sp, init_std=0.05)
        with torch.no_grad():
            for m in (ref, par):
                if m.bias is not None:
                    m.bias.copy_(torch.linspace(-1, 1, h))
        X = randn((b, s, n), seed + 100 + k).requires_grad_()
        G = randn((b, s, h), seed + 200 + k)
        Y = ref(X)
        Y.backward(G)
        x = (last_dim_shard(X, mesh) if parallel_in else X.detach().clone()).requires_grad_()
        y = par(x)
        if skip:
            y, bb = y
            y = y if bb is None else y + bb
        assert_close(y, _residual(Y, mesh, sp), TOL, f"{what} forward")
        y.backward(_residual(G, mesh, sp))
        assert_close(x.grad, last_dim_shard(X.grad, mesh) if parallel_in else X.grad, TOL, f"{what} input grad")
        compare_parameters(par, ref, mesh, what)
        assert par.weight.shape == (h, n // T)
        if bias and not skip:      # autocast over fp32 parameters: the output in the compute dtype, as F.linear's
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y16, Y16 = par(x.detach()), ref(X.detach())
            assert y16.dtype == Y16.dtype == torch.bfloat16, (what, y16.dtype)
            assert_close(y16.float(), _residual(Y16.float(), mesh, sp), 5e-2, f"{what} bf16 autocast forward")


def _gate_up(y, blocks):
    """(gate, up) of a [.., 2f] output made of ``blocks`` column blocks, each [gate part; up part]."""
    y = y.unflatten(-1, (blocks, 2, -1))
    return y[..., 0, :].flatten(-2), y[..., 1, :].flatten(-2)


def _check_mlp_and_ledger(mesh, sp, b, s, h, seed):
    """Column(h→2f, bias) → SwiGLU → Row(f→h, bias): the Megatron pair; ledger == theory. Rank t's
    column block is [gate block t; up block t], so the reference takes gate and up from the T
    column blocks of its output in the same way (:func:`_gate_up`)."""
    T, f = mesh.tensor.size, 4 * h
    what = f"mlp(b,s,h={b},{s},{h})"
    torch.manual_seed(seed)
    ref_up, ref_down = plain_linear(h, 2 * f, True, 0.05), plain_linear(f, h, True, 0.05)
    torch.manual_seed(seed)
    up = ColumnParallelLinear(h, 2 * f, mesh, bias=True, sequence_parallel=sp, init_std=0.05)
    down = RowParallelLinear(f, h, mesh, bias=True, sequence_parallel=sp, init_std=0.05)
    with torch.no_grad():
        ref_up.bias.normal_(generator=torch.Generator().manual_seed(seed + 1))
        ref_down.bias.normal_(generator=torch.Generator().manual_seed(seed + 2))
        up.bias.copy_(expected_shard(ref_up.bias, up.bias.shard_spec, mesh))
        down.bias.copy_(ref_down.bias)

    def mlp(x, a, c, blocks):
        gate, u = _gate_up(a(x), blocks)
        return c(F.silu(gate) * u)

    X = randn((b, s, h), seed + 3).requires_grad_()
    G = randn((b, s, h), seed + 4)
    Y = mlp(X, ref_up, ref_down, T)
    Y.backward(G)
    x = _input(X, mesh, sp)
    LEDGER.reset()
    y = mlp(x, up, down, 1)
    y.backward(_residual(G, mesh, sp))
    assert_close(y, _residual(Y, mesh, sp), TOL, f"{what} forward")
    assert_close(x.grad, _residual(X.grad, mesh, sp), TOL, f"{what} input grad")
    compare_parameters(up, ref_up, mesh, what + " up")
    compare_parameters(down, ref_down, mesh, what + " down")
    theory = tp1d.column_row_comm(b, s, h, T, sp, row_bias=True)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        assert LEDGER.count(op) == theory.count(op), f"{what} {op} count {LEDGER.count(op)} != {theory.count(op)}"
        assert LEDGER.payload_bytes(op) == theory.payload_bytes(op), f"{what} {op} bytes"
    # ring wire bytes, written out (the ledger and the theory share ring_wire_bytes, so comparing
    # them would not test it): no SP 2 all-reduces of A, 2(T−1)/T·A each; SP 3 all-gathers (the
    # column input forward, re-gathered in backward; the row output gradient) + 2 reduce-scatters
    # of A, (T−1)/T·A each (the row bias gradient is summed from the gathered output gradient: no
    # all-reduce of its own)
    A = b * s * h * 4
    want = (5 if sp else 4) * (T - 1) / T * A
    assert LEDGER.total("wire_bytes") == pytest.approx(want, rel=1e-12), f"{what} wire bytes"
    assert theory.wire_bytes() == pytest.approx(want, rel=1e-12), f"{what} theory wire bytes"
    if sp and T > 1 and b > 1:
        # the SP region's own layout: the block stored sequence-first (as the SP embedding and row
        # layers leave it) takes the copy-free collectives; the same values, and the output and the
        # input gradient come back sequence-first
        for p in (*up.parameters(), *down.parameters()):
            p.grad = None
        xs = _residual(X, mesh, sp).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
        y = mlp(xs, up, down, 1)
        assert y.transpose(0, 1).is_contiguous(), f"{what}: output strides {y.stride()} not sequence-first"
        y.backward(_residual(G, mesh, sp).transpose(0, 1).contiguous().transpose(0, 1))
        assert_close(y, _residual(Y, mesh, sp), TOL, f"{what} sequence-first forward")
        assert_close(xs.grad, _residual(X.grad, mesh, sp), TOL, f"{what} sequence-first input grad")
        compare_parameters(up, ref_up, mesh, what + " up (sequence-first)")
        compare_parameters(down, ref_down, mesh, what + " down (sequence-first)")


def _check_embedding(mesh, sp, b, s, h, seed):
    T = mesh.tensor.size
    for vocab in (37, 5, 40):
        what = f"embedding(V={vocab}, b,s,h={b},{s},{h})"
        torch.manual_seed(seed)
        ref = plain_embedding(vocab, h, 0.05)
        torch.manual_seed(seed)
        par = VocabParallelEmbedding(vocab, h, mesh, init_std=0.05, sequence_parallel=sp)
        assert par.padded_vocab == padded_vocab_size(vocab, T) and par.weight.shape[0] == par.padded_vocab // T
        tokens = randint(vocab, (b, s), seed + 1)
        tokens[0, 0], tokens[-1, -1] = vocab - 1, 0
        G = randn((b, s, h), seed + 2)
        Y = ref(tokens)
        Y.backward(G)
        LEDGER.reset()
        y = par(tokens)
        y.backward(_residual(G, mesh, sp))
        assert_close(y, _residual(Y, mesh, sp), TOL, f"{what} forward")
        compare_parameters(par, ref, mesh, what)
        theory = tp1d.embedding_comm(b, s, h, T, sp)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            assert (LEDGER.count(op), LEDGER.payload_bytes(op)) == (theory.count(op), theory.payload_bytes(op)), \
                f"{what} ledger {op}"


def _check_cross_entropy(mesh, b, s, seed):
    """Per-token loss and logit gradient; padding columns hold large garbage that must not count."""
    T = mesh.tensor.size
    for vocab in (37, 5, 40):
        what = f"cross_entropy(V={vocab}, b,s={b},{s})"
        padded = padded_vocab_size(vocab, T)
        Z = (randn((b, s, vocab), seed + 1, scale=3.0)).requires_grad_()
        targets = randint(vocab, (b, s), seed + 2)
        targets[0, 1], targets[-1, 0] = -100, vocab - 1
        W = randn((b, s), seed + 3)
        L = F.cross_entropy(Z.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100, reduction="none")
        L.backward(W.reshape(-1))
        garbage = pad_to(Z.detach(), (b, s, padded), fill=50.0)
        z = last_dim_shard(garbage, mesh).requires_grad_()
        LEDGER.reset()
        loss = vocab_parallel_cross_entropy(z, targets, mesh, ignore_index=-100, vocab_size=vocab)
        assert loss.shape == targets.shape
        assert_close(loss, L.detach().reshape(b, s), TOL, f"{what} per-token loss")
        assert float(loss[0, 1]) == 0.0
        loss.backward(W)
        assert_close(z.grad, last_dim_shard(pad_to(Z.grad, (b, s, padded)), mesh), TOL, f"{what} logits grad")
        theory = tp1d.cross_entropy_comm(b * s, T)
        assert (LEDGER.count("all_reduce"), LEDGER.payload_bytes("all_reduce")) == \
               (theory.count("all_reduce"), theory.payload_bytes("all_reduce")), f"{what} ledger"
        # the laid-out model's loss: mean over the non-ignored tokens, the same scalar as F.cross_entropy
        mean = ParallelContext(mesh, "1d", False, vocab).loss(z.detach(), targets)
        assert_close(mean, F.cross_entropy(Z.detach().reshape(-1, vocab), targets.reshape(-1)), TOL, f"{what} mean")
    # without padding and without vocab_size (V = T·V_l)
    Z = randn((b, s, 8 * T), seed + 4)
    targets = randint(8 * T, (b, s), seed + 5)
    loss = vocab_parallel_cross_entropy(last_dim_shard(Z, mesh), targets, mesh.tensor)
    assert_close(loss, F.cross_entropy(Z.reshape(-1, 8 * T), targets.reshape(-1), reduction="none").reshape(b, s),
                 TOL, "cross_entropy without padding")


def _check_norm(mesh, sp, b, s, h, seed):
    T = mesh.tensor.size
    what = f"rmsnorm(b,s,h={b},{s},{h})"
    ref = nn.RMSNorm(h, eps=1e-5)
    par = RMSNorm(h, 1e-5, mesh, sequence_parallel=sp)
    with torch.no_grad():
        w = 1.0 + 0.1 * randn((h,), seed)
        ref.weight.copy_(w)
        par.weight.copy_(w)
    X = randn((b, s, h), seed + 1).requires_grad_()
    G = randn((b, s, h), seed + 2)
    Y = ref(X)
    Y.backward(G)
    x = _input(X, mesh, sp)
    LEDGER.reset()
    y = par(x)
    y.backward(_residual(G, mesh, sp))
    assert_close(y, _residual(Y, mesh, sp), TOL, f"{what} forward")
    assert_close(x.grad, _residual(X.grad, mesh, sp), TOL, f"{what} input grad")
    assert_close(par.weight.grad, ref.weight.grad, TOL, f"{what} weight grad")
    assert par.weight.shard_spec.partial_grad_axes == (("tensor",) if sp and T > 1 else ())
    theory = tp1d.norm_comm(h, T, sp)
    assert (LEDGER.count(), LEDGER.payload_bytes()) == (theory.count("all_reduce"), theory.payload_bytes())


def _layers(T, sp):
    mesh = mesh_1d(T)
    for i, (b, s, h) in enumerate(SHAPES):
        seed = 1000 * (i + 1) + 10 * T + int(sp)
        _check_column(mesh, sp, b, s, h, seed)
        _check_input_grad_overlap(mesh, sp, b, s, h, seed + 900)
        if sp:
            _check_column_saves_its_block(mesh, b, s, h, seed + 950)
        _check_row(mesh, sp, b, s, h, seed + 300)
        _check_mlp_and_ledger(mesh, sp, b, s, h, seed + 500)
        _check_embedding(mesh, sp, b, s, h, seed + 600)
        _check_norm(mesh, sp, b, s, h, seed + 700)
        if not sp:
            _check_cross_entropy(mesh, b, s, seed + 800)
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_layers_match_reference(T, sp):
    assert all(run_on_ranks(T, _layers, T, sp, timeout=120))


def test_theory_sequence_parallel_moves_the_same_wire_volume_but_the_regather():
    for T in (2, 4, 8):
        plain, sp = tp1d.block_comm(2, 16, 64, T, False), tp1d.block_comm(2, 16, 64, T, True)
        norm = tp1d.norm_comm(64, T, True).wire_bytes() * 2
        regather = 2 * (T - 1) / T * (2 * 16 * 64 * 4)
        assert sp.wire_bytes() - norm - regather == pytest.approx(plain.wire_bytes())
        A = 2 * 16 * 64 * 4     # 4 all-reduces of A per block, 2(T−1)/T·A each, written out
        assert plain.wire_bytes() == pytest.approx(4 * 2 * (T - 1) / T * A, rel=1e-12)
        assert plain.payload_bytes("all_reduce") == 4 * 2 * 16 * 64 * 4
        assert sp.payload_bytes("reduce_scatter") == 4 * 2 * 16 * 64 * 4
        # the two column inputs are all-gathered again in backward (their sequence block is what is saved)
        assert sp.payload_bytes("all_gather") == 6 * 2 * 16 * 64 * 4
    assert tp1d.block_comm(2, 16, 64, 1, True).payload_bytes() == 0
    residual = lambda sp: TensorMode("1d").rank_shape(ModelConfig(hidden=64), 4, sp, 2 * 16).residual  # noqa: E731
    assert residual(True) * 4 == residual(False) == 2 * 16 * 64
