"""Cross-entropy with large-magnitude logits: every loss path equals F.cross_entropy.

Logits of magnitude 100 … 1e4 (fp32) overflow ``exp`` unless the row maximum is
subtracted first (exp(89) is already inf in fp32; exp(−104) is 0): a loss without the
max shift returns inf/NaN here while ``F.cross_entropy`` is finite. Checked, forward
and backward, against ``F.cross_entropy`` in float64 on the same (fp32) global logits:

* the plain path (``ParallelContext.loss`` in mode ``none``, i.e. fp32 ``F.cross_entropy``);
* the 1D vocab-parallel loss (:func:`vocab_parallel_cross_entropy`) at T = 2;
* the 2D loss (:func:`cross_entropy_2d`) at q = 2.

Rows include uniform rows at ±1e4, a single +1e4 spike among −1e4 (loss exactly 0 when
the spike is the target, 2e4 when it is not), random rows at scales 100, 1e3, 1e4;
targets include 0, vocab − 1 and ``ignore_index`` (V and −1 must be refused). The
padding columns of the sharded vocabulary hold +1e5 garbage (larger than every real
logit), so a loss that let the padding into the maximum or the sum would be wrong too. The sharded logits gradients
are all-gathered back to the full padded vocabulary and compared with the reference
gradient (padding columns must get exactly 0).

Tolerances (elementwise, ``torch.testing.assert_close``): the inputs are exactly
representable in both precisions, so the only error is fp32 rounding inside the loss.
The loss of a token is log S − (z_t − m) with both terms ≥ 0 (no cancellation), so its
relative error is a few fp32 ulps (≈ 1e-7); rtol = 1e-5 leaves 100× headroom.
Gradient entries are softmax − onehot ∈ [−1, 1]: p − 1 for p ≈ 1 cancels, so each
entry has an absolute error of about one fp32 ulp of 1 (1.2e-7) times the upstream
weight (≤ 3 here): atol = 1e-6. A missing max shift is not a small error: it gives inf
or NaN, which no tolerance accepts.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gridshard.tensor.tp1d.cross_entropy import vocab_parallel_cross_entropy
from gridshard.errors import ShapeError
from gridshard.tensor.tp2d.cross_entropy import cross_entropy_2d
from gridshard.tensor.tp1d.embedding import check_token_range
from gridshard.parallel import ParallelContext
from gridshard.testing import run_on_ranks

from .test_tp1d_helpers import mesh_1d
from .test_tp2d_helpers import mesh_2d

IGNORE = -100
VOCAB = 11                 # padded to 12 at T = 2 and at q = 2: one padding column
B, S = 4, 3                # 12 tokens; the batch splits over q = 2
PAD_GARBAGE = 1e5          # padding logits, larger than every real one
RTOL_LOSS, ATOL_LOSS = 1e-5, 1e-6
RTOL_GRAD, ATOL_GRAD = 1e-5, 1e-6


def _logits_and_targets(seed):
    """Global fp32 logits [B, S, VOCAB] of magnitude 100 … 1e4 and targets [B, S]."""
    g = torch.Generator().manual_seed(seed)
    V = VOCAB
    rows = [
        torch.full((V,), 1e4),                                   # uniform, huge positive
        torch.full((V,), -1e4),                                  # uniform, huge negative
        torch.full((V,), -1e4).index_fill_(0, torch.tensor([V - 1]), 1e4),   # spike at the target V-1
        torch.full((V,), -1e4).index_fill_(0, torch.tensor([0]), 1e4),       # spike at 0, target V-1
        torch.full((V,), -1e4).index_fill_(0, torch.tensor([0]), 1e4),       # spike at the target 0
    ]
    for scale in (100.0, 300.0, 1e3, 1e4, 100.0, 1e3, 1e4):
        rows.append(torch.randn(V, generator=g) * scale)
    Z = torch.stack(rows).reshape(B, S, V).float()
    targets = torch.randint(0, V, (B * S,), generator=g)
    targets[:5] = torch.tensor([V - 1, 0, V - 1, V - 1, 0])
    targets[5], targets[6], targets[7] = 0, V - 1, IGNORE        # random rows: both ends and ignored
    targets[-1] = IGNORE
    return Z, targets.reshape(B, S)


def _reference(Z, targets, reduction, upstream=None):
    """F.cross_entropy in float64 on the same fp32 values: (loss, dloss/dZ)."""
    z = Z.detach().double().requires_grad_()
    loss = F.cross_entropy(z.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction=reduction)
    loss.backward(None if upstream is None else upstream.reshape(-1).double())
    return loss.detach(), z.grad


def _padded(Z, padded):
    pad = torch.full((*Z.shape[:-1], padded - VOCAB), PAD_GARBAGE)
    return torch.cat([Z, pad], -1)


def _gather_last_dim(local, axis_size):
    """The full last dim from every tensor rank's block (ranks in tensor order; 1D world = tensor group)."""
    parts = [torch.empty_like(local) for _ in range(axis_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, -1)


def _check(actual, expected, rtol, atol, what):
    assert torch.isfinite(actual).all(), f"{what}: not finite where F.cross_entropy is: {actual}"
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---- extreme targets: the range check every loss and embedding runs first ------------------------------------
def test_targets_at_the_vocabulary_edges():
    """0, V−1 and ignore_index pass; V and −1 (one past each end) are refused with the id."""
    check_token_range(torch.tensor([0, VOCAB - 1, IGNORE]), VOCAB, "targets", IGNORE)
    for bad in (VOCAB, -1):
        with pytest.raises(ShapeError, match=rf"targets: id {bad} is outside the vocabulary \[0, {VOCAB}\)"):
            check_token_range(torch.tensor([0, bad, VOCAB - 1]), VOCAB, "targets", IGNORE)
    with pytest.raises(ShapeError, match=rf"id {IGNORE} is outside"):     # without ignore_index it is an id
        check_token_range(torch.tensor([IGNORE]), VOCAB, "targets")


# ---- plain path ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_plain_loss_with_huge_logits(seed):
    Z, targets = _logits_and_targets(seed)
    ref_loss, ref_grad = _reference(Z, targets, "mean")
    assert torch.isfinite(ref_loss) and ref_loss > 1e3, "the inputs must really be extreme"
    z = Z.clone().requires_grad_()
    loss = ParallelContext(None, "none", False, VOCAB).loss(z, targets, ignore_index=IGNORE)
    loss.backward()
    _check(loss, ref_loss, RTOL_LOSS, ATOL_LOSS, f"plain loss seed={seed}")
    _check(z.grad, ref_grad, RTOL_GRAD, ATOL_GRAD, f"plain logits grad seed={seed}")


# ---- 1D: vocab-parallel over T ranks ----------------------------------------------------------------------------
def _vocab_parallel_1d(T, seed):
    mesh = mesh_1d(T)
    Z, targets = _logits_and_targets(seed)
    W = torch.randn(B, S, generator=torch.Generator().manual_seed(seed + 7)) * 3   # upstream per-token weights
    ref_loss, ref_grad = _reference(Z, targets, "none", W)
    padded = -(-VOCAB // T) * T
    local = _padded(Z, padded).chunk(T, -1)[mesh.tensor.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mesh, ignore_index=IGNORE, vocab_size=VOCAB)
    loss.backward(W)
    what = f"1D T={T} seed={seed}"
    _check(loss, ref_loss.reshape(B, S), RTOL_LOSS, ATOL_LOSS, f"{what} per-token loss")
    assert float(loss[-1, -1]) == 0.0, f"{what}: an ignored token must have loss 0"
    full_grad = _gather_last_dim(local.grad, T)
    assert torch.equal(full_grad[..., VOCAB:], torch.zeros_like(full_grad[..., VOCAB:])), \
        f"{what}: padding columns got a gradient"
    _check(full_grad[..., :VOCAB], ref_grad.reshape(B, S, VOCAB), RTOL_GRAD, ATOL_GRAD, f"{what} logits grad")
    return float(loss.sum())


@pytest.mark.parametrize("seed", [1, 2])
def test_1d_vocab_parallel_loss_with_huge_logits(seed):
    sums = run_on_ranks(2, _vocab_parallel_1d, 2, seed, timeout=60)
    assert sums[0] == sums[1], f"tensor ranks disagree on the loss: {sums}"


# ---- 2D: q×q grid -----------------------------------------------------------------------------------------------
def _cross_entropy_2d(q, seed):
    mesh = mesh_2d(q)
    Z, targets = _logits_and_targets(seed)
    ref_loss, ref_grad = _reference(Z, targets, "mean")
    padded = -(-VOCAB // q) * q
    i, j = mesh.grid_row, mesh.grid_col
    local = _padded(Z, padded).chunk(q, 0)[i].chunk(q, -1)[j].clone().requires_grad_()
    loss = cross_entropy_2d(local, targets.chunk(q, 0)[i], mesh, VOCAB, ignore_index=IGNORE)
    loss.backward()
    what = f"2D q={q} seed={seed}"
    _check(loss, ref_loss, RTOL_LOSS, ATOL_LOSS, f"{what} loss")
    # the grid in tensor order t = i·q + j: block (i, j) is batch block i, vocabulary block j
    blocks = [torch.empty_like(local.grad) for _ in range(q * q)]
    dist.all_gather(blocks, local.grad.contiguous())
    full_grad = torch.cat([torch.cat(blocks[r * q:(r + 1) * q], -1) for r in range(q)], 0)
    assert torch.equal(full_grad[..., VOCAB:], torch.zeros_like(full_grad[..., VOCAB:])), \
        f"{what}: padding columns got a gradient"
    _check(full_grad[..., :VOCAB], ref_grad.reshape(B, S, VOCAB), RTOL_GRAD, ATOL_GRAD, f"{what} logits grad")
    return float(loss)


@pytest.mark.parametrize("seed", [1, 2])
def test_2d_loss_with_huge_logits(seed):
    losses = run_on_ranks(4, _cross_entropy_2d, 2, seed, timeout=60)
    assert len(set(losses)) == 1, f"grid ranks disagree on the loss: {losses}"
