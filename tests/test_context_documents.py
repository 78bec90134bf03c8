"""Context-parallel attention with document masks (packed windows) against one process.

Reference: F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(docs, docs),
enable_gqa=True) on the global tensors. Every rank's output rows and q/k/v gradients equal that
reference's rows within 1e-5 (fp32), for the ring at C = 2 and 4 and all-to-all at C = 2, with
grouped-query heads, on windows whose documents cross chunk boundaries, are many and short, are one
per row (then plain causal), and differ between rows. The ring sends only what its routes need: the
ledger equals gridshard.theory.context.ring_route_sends and is below the whole-block ring's.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gridshard.comm.ledger import CommLedger, use_ledger
from gridshard.context import all_to_all_attention, ring_attention, shard_sequence
from gridshard.context.ring_attention import chunk_routes
from gridshard.context.sequence_split import chunk_indices
from gridshard.mesh import Axis
from gridshard.nn.documents import attention_mask, blocks_meet, check_documents, chunk_blocks, document_positions
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error
from gridshard.theory.context import ring_attention_sends, ring_route_sends

TOL = 1e-5
S, B, H, H_KV, D = 32, 2, 4, 2, 8


def _ids(*rows) -> torch.Tensor:
    """[len(rows), Σ lengths] document ids of rows given by their documents' lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def _short(seed: int, n: int = S) -> list:
    """Lengths 1 … 3 of many short documents filling ``n`` tokens."""
    g, out = torch.Generator().manual_seed(seed), []
    while sum(out) < n:
        out.append(min(int(torch.randint(1, 4, (1,), generator=g)), n - sum(out)))
    return out


LAYOUTS = {
    "crossing": _ids([5, 11, 9, 7], [13, 3, 16]),      # documents over chunk boundaries, rows differ
    "short": _ids(_short(1), _short(2)),                # many short documents
    "one": _ids([S], [S]),                              # one document per row: plain causal
    "mixed": _ids([S], _short(3)),                      # one row whole, the other many documents
}


def _reference(docs, seed):
    g = torch.Generator().manual_seed(seed)
    Q, K, V, G = (torch.randn(B, h, S, D, generator=g) for h in (H, H_KV, H_KV, H))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    ref = F.scaled_dot_product_attention(Q, K, V, attn_mask=attention_mask(docs, docs), enable_gqa=True)
    ref.backward(G)
    return (Q, K, V, G), ref


def _axis():
    C, r = dist.get_world_size(), dist.get_rank()
    return Axis("context", C, r, tuple(range(C)), dist.group.WORLD)


def _case(mode):
    """Per layout: relative errors of this rank's output and q/k/v gradients against the reference."""
    axis = _axis()
    C, r = axis.size, axis.rank
    errs = {}
    for seed, (name, docs) in enumerate(LAYOUTS.items()):
        (Q, K, V, G), ref = _reference(docs, seed)
        q, k, v = (shard_sequence(t.detach(), C, r, dim=2).requires_grad_() for t in (Q, K, V))
        out = (ring_attention if mode == "ring" else all_to_all_attention)(q, k, v, axis, documents=docs)
        out.backward(shard_sequence(G, C, r, dim=2))
        errs[name] = max(relative_error(mine, shard_sequence(want.detach(), C, r, dim=2))
                         for mine, want in ((out, ref), (q.grad, Q.grad), (k.grad, K.grad), (v.grad, V.grad)))
        if name == "one":                               # one document per row is plain causal attention
            causal = F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=True)
            errs["one=causal"] = relative_error(out, shard_sequence(causal.detach(), C, r, dim=2))
    return errs


@pytest.mark.parametrize("mode,C", [("ring", 2), ("ring", 4), ("all_to_all", 2)])
def test_context_attention_with_documents_matches_masked_attention(mode, C):
    for rank, errs in enumerate(run_on_ranks(C, _case, mode)):
        assert max(errs.values()) <= TOL, (rank, errs)


def _ledger_case(docs):
    """This rank's ring sends (calls, bytes) forward and backward, with and without documents."""
    axis = _axis()
    C, r = axis.size, axis.rank
    (Q, K, V, G), _ = _reference(docs, 5)
    sends = {}
    for key, ids in (("documents", docs), ("causal", None)):
        q, k, v = (shard_sequence(t.detach(), C, r, dim=2).requires_grad_() for t in (Q, K, V))
        ledger = CommLedger()
        with use_ledger(ledger):
            out = ring_attention(q, k, v, axis, documents=ids)
            fwd = (ledger.count("send"), ledger.payload_bytes("send"))
            out.backward(shard_sequence(G, C, r, dim=2))
        total = (ledger.count("send"), ledger.payload_bytes("send"))
        sends[key] = {"forward": fwd, "backward": (total[0] - fwd[0], total[1] - fwd[1])}
    return sends


def test_ring_sends_only_what_the_documents_need():
    """Short documents at C = 4 (c = 4 tokens a chunk): the few chunks whose documents run into a
    later chunk travel as far as their furthest consumer; each rank's sends equal the closed form,
    and the whole ring's sends are below the causal ring's."""
    C, docs = 4, LAYOUTS["short"]
    routes = chunk_routes(docs, C)
    assert any(L > 0 for _, L in routes) and any(L == 0 for _, L in routes), routes
    theory = ring_route_sends(C, B, S // C, H_KV, D, routes)
    results = run_on_ranks(C, _ledger_case, docs)
    for rank, sends in enumerate(results):
        assert sends["documents"] == theory[rank], (rank, sends, theory[rank])
        assert sends["causal"] == ring_attention_sends(C, B, S // C, H, H_KV, D)
    for direction in ("forward", "backward"):
        masked = sum(s["documents"][direction][1] for s in results)
        causal = sum(s["causal"][direction][1] for s in results)
        assert masked < causal, (direction, masked, causal)


def test_route_sends_without_documents_are_the_whole_block_ring():
    for C in (1, 2, 3, 4, 8):
        whole = [(0, C - 1)] * (2 * C)
        assert ring_route_sends(C, 2, 16, 2, 8, whole, 2) == [ring_attention_sends(C, 2, 16, 4, 2, 8, 2)] * C


def _consumers(docs, C, b):
    """Brute force: ring distances from chunk b's owner of the other ranks whose queries attend some
    key of chunk b in some row, read from the whole window's mask."""
    c, mask = S // (2 * C), attention_mask(docs, docs)[:, 0]
    owner = next(r for r in range(C) if b in chunk_indices(C, r))
    return sorted((s - owner) % C for s in range(C) if s != owner
                  and any(bool(mask[:, a * c:(a + 1) * c, b * c:(b + 1) * c].any()) for a in chunk_indices(C, s)))


@pytest.mark.parametrize("C", [2, 4])
def test_chunk_routes_reach_the_first_and_furthest_consumer(C):
    for docs in list(LAYOUTS.values()) + [_ids(_short(s, S), [S - 10, 10]) for s in range(4, 10)]:
        for b, (f, L) in enumerate(chunk_routes(docs, C)):
            dists = _consumers(docs, C, b)
            assert (f, L) == ((dists[0], dists[-1]) if dists else (1, 0)), (b, dists, (f, L))


def test_documents_positions_masks_and_block_meetings():
    docs = _ids([3, 1, 4], [8])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], list(range(8))]
    mask = attention_mask(docs, docs)[:, 0]
    i, j = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    assert torch.equal(mask, (docs[:, :, None] == docs[:, None, :]) & (j <= i))
    assert torch.equal(mask[1], torch.ones(8, 8, dtype=torch.bool).tril())
    pos = torch.arange(8)                       # a block of the window: queries 4…7, keys 0…3
    assert torch.equal(attention_mask(docs[:, 4:], docs[:, :4], pos[4:], pos[:4])[:, 0], mask[:, 4:, :4])
    assert not blocks_meet(docs[:1], (0, 4), (4, 8)) and blocks_meet(docs, (0, 4), (4, 8))
    assert blocks_meet(docs[:1], (2, 4), (4, 6)) is False and blocks_meet(docs[:1], (4, 5), (5, 8))
    with pytest.raises(ValueError, match="not all before"):
        blocks_meet(docs, (0, 5), (4, 8))
    for docs in list(LAYOUTS.values()):         # chunk_blocks: blocks_meet of every pair, and plain masks
        n, c = 8, S // 8
        meets, whole = chunk_blocks(docs, n)
        full = attention_mask(docs, docs)[:, 0]
        for k in range(n):
            for q in range(n):
                block = full[:, q * c:(q + 1) * c, k * c:(k + 1) * c]
                plain = torch.ones(c, c, dtype=torch.bool).tril() if k == q else torch.ones(c, c, dtype=torch.bool)
                assert meets[k][q] == (k <= q and blocks_meet(docs, (k * c, (k + 1) * c), (q * c, (q + 1) * c)))
                assert meets[k][q] == bool(block.any())
                assert whole[k][q] == (k <= q and bool((block == plain).all()))
    with pytest.raises(ValueError, match="decrease"):
        check_documents(torch.tensor([[0, 1, 0]]), (1, 3))
    with pytest.raises(ValueError, match="do not match tokens"):
        check_documents(torch.zeros(1, 4, dtype=torch.long), (1, 3))
    with pytest.raises(ValueError, match="multiple of 3"):
        chunk_blocks(docs, 3)


def test_masked_block_kernels_empty_rows_and_merge():
    """CPU flash and the matmul block with a mask that empties some rows: equal outputs, ℓ = −∞ and
    O = 0 on the empty rows, and a backward (with a finite merged ℓ) that adds nothing there; the
    ring at C = 1 merges a block of empty rows without NaN (the first block of a late chunk)."""
    from gridshard.context.blocks import CPU, MATMUL
    g = torch.Generator().manual_seed(0)
    q, dO = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, 6, 5, generator=g) > 0.5
    mask[0, 0, 2], mask[1, 0, 4] = False, False
    (o, lse), (o_ref, lse_ref) = (kern.forward(q, k, v, 0.3, False, mask) for kern in (CPU, MATMUL))
    empty = ~mask.any(-1).expand_as(lse)
    assert bool((lse[empty] == float("-inf")).all()) and torch.equal(lse.isinf(), lse_ref.isinf())
    assert not o.isnan().any() and bool((o[empty] == 0).all())
    assert relative_error(o, o_ref) <= TOL and relative_error(lse[~empty], lse_ref[~empty]) <= TOL
    merged = torch.rand(2, 4, 6, generator=g) + 2.0
    grads, ref = (kern.backward(dO, q, k, v, o_ref, merged, 0.3, False, mask) for kern in (CPU, MATMUL))
    for mine, want in zip(grads, ref):
        assert relative_error(mine, want) <= TOL
    assert bool((grads[0][empty] == 0).all())
    with pytest.raises(ValueError, match="both causal=True and a mask"):
        CPU.forward(q, k, v, 0.3, True, mask)
    docs = _ids([5, 11, 9, 7], [13, 3, 16])       # C = 1: one rank, every block of the ring's step 0
    (Q, K, V, G), ref = _reference(docs, 9)
    q, k, v = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    out = ring_attention(q, k, v, Axis("context", 1, 0, (0,), None), documents=docs)
    out.backward(G)
    for mine, want in ((out, ref), (q.grad, Q.grad), (k.grad, K.grad), (v.grad, V.grad)):
        assert relative_error(mine, want) <= TOL


def test_cuda_masked_kernels_take_their_arguments():
    """Without a GPU (meta tensors run the ops' shape functions): the efficient kernel takes the
    mask as its padded, head-expanded additive bias, forward and backward; flash refuses a mask."""
    from gridshard.context import blocks
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, h, 40, 16, generator=g).to("meta", torch.bfloat16) for h in (4, 2, 2, 4))
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool, device="meta")
    o, lse = blocks.CUDA_EFFICIENT.forward(q, k, v, 0.25, False, mask)
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    grads = blocks.CUDA_EFFICIENT.backward(dO, q, k, v, o, lse, 0.25, False, mask)
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    bias = blocks._efficient_bias(q, torch.ones(2, 1, 40, 40, dtype=torch.bool))
    assert bias.shape == (2, 4, 40, 40) and bias.stride() == (40 * 48, 0, 48, 1)
    with pytest.raises(ValueError, match="flash attention takes no mask"):
        blocks.CUDA_FLASH.forward(q, k, v, 0.25, False, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_cuda_masked_block_kernel_equals_the_matmul_block(dtype, tol):
    """On a GPU: ``block_kernel(q, masked=True)`` (the efficient kernel) against the fp32 matmul block."""
    from gridshard.context.blocks import MATMUL, block_kernel
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, h, 40, 16, generator=g).to("cuda", dtype) for h in (4, 2, 2, 4))
    docs = _ids([7, 20, 13], [40]).cuda()
    mask = attention_mask(docs, docs)
    kernel = block_kernel(q, masked=True)
    assert kernel.name == "cuda_efficient"
    (o, lse), (o_ref, lse_ref) = (kern.forward(q, k, v, 0.25, False, mask) for kern in (kernel, MATMUL))
    assert relative_error(o, o_ref) <= tol and relative_error(lse, lse_ref) <= tol
    grads = kernel.backward(dO, q, k, v, o_ref.to(dtype), lse_ref, 0.25, False, mask)
    for mine, want in zip(grads, MATMUL.backward(dO, q, k, v, o_ref, lse_ref, 0.25, False, mask)):
        assert relative_error(mine, want) <= tol
