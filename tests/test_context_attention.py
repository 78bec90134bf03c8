"""Context parallelism's attention against plain causal attention on the whole sequence.

The sequence is split load-balanced over C ranks (rank i: chunks i and 2C − 1 − i); every
rank's output rows and its q/k/v gradients equal those rows of F.scaled_dot_product_attention
(causal, grouped-query) on the global tensors within 1e-5 (fp32), and the ledger's sends equal
gridshard.theory.context.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gridshard.comm.ledger import CommLedger, use_ledger
from gridshard.errors import LayoutError
from gridshard.context import all_to_all_attention, global_positions, ring_attention, shard_sequence, unshard_sequence
from gridshard.mesh import Axis
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import relative_error
from gridshard.theory.context import all_to_all_attention_volume, ring_attention_sends

TOL = 1e-5


def test_split_round_trips_and_positions_are_global():
    x = torch.arange(2 * 24).view(2, 24)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    assert torch.equal(unshard_sequence(parts), x)
    for r in range(3):     # the positions of the tokens a rank holds are their global indices
        assert torch.equal(parts[r][0], global_positions(8, 3, r))
    # balanced causal work: rank i's chunks attend to (i + 1) + (2C - i) chunks, the same for all
    assert {(r + 1) + (2 * 3 - r) for r in range(3)} == {7}
    with pytest.raises(LayoutError, match="seq_len must be a multiple of 6"):
        shard_sequence(torch.zeros(1, 20), 3, 0)


def _case(mode, b, S, H, H_kv, d, seed):
    op = "send" if mode == "ring" else "all_to_all"
    C, r = dist.get_world_size(), dist.get_rank()
    axis = Axis("context", C, r, tuple(range(C)), dist.group.WORLD)
    g = torch.Generator().manual_seed(seed)
    Q, K, V, G = (torch.randn(b, h, S, d, generator=g) for h in (H, H_kv, H_kv, H))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    ref = F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=H != H_kv)
    ref.backward(G)
    q, k, v = (shard_sequence(t.detach(), C, r, dim=2).requires_grad_() for t in (Q, K, V))
    ledger = CommLedger()
    with use_ledger(ledger):
        out = (ring_attention if mode == "ring" else all_to_all_attention)(q, k, v, axis)
        fwd = (ledger.count(op), ledger.payload_bytes(op))
        out.backward(shard_sequence(G, C, r, dim=2))
    total = (ledger.count(op), ledger.payload_bytes(op))
    wire_ok = ledger.total("wire_bytes", op=op) == (total[1] if mode == "ring" else (C - 1) / C * total[1])
    theory = (ring_attention_sends if mode == "ring" else all_to_all_attention_volume)(C, b, S // C, H, H_kv, d, 4)
    bwd = (total[0] - fwd[0], total[1] - fwd[1])
    errs = {}
    for name, mine, want in (("out", out, ref), ("dq", q.grad, Q.grad), ("dk", k.grad, K.grad),
                             ("dv", v.grad, V.grad)):
        errs[name] = relative_error(mine, shard_sequence(want.detach(), C, r, dim=2))
    return errs, fwd == theory["forward"] and wire_ok, bwd == theory["backward"]


@pytest.mark.parametrize("mode,H,H_kv", [("ring", 4, 2), ("ring", 2, 2), ("all_to_all", 8, 4), ("all_to_all", 8, 2),
                                        ("all_to_all", 4, 1)])
def test_context_attention_matches_causal_attention(mode, H, H_kv):
    for errs, fwd_ok, bwd_ok in run_on_ranks(4, _case, mode, 2, 16, H, H_kv, 8, seed=7 + H_kv):
        assert fwd_ok and bwd_ok
        assert max(errs.values()) <= TOL, errs


def _one_rank_axis():
    return Axis("context", 1, 0, (0,), None)


@pytest.mark.parametrize("H,H_kv", [(4, 2), (2, 2)])
def test_ring_at_c1_equals_sdpa_and_block_kernels_equal_the_matmul_blocks(H, H_kv):
    """One process, no communication: C = 1 runs the ring's step 0 (two causal diagonal blocks and
    one full block, merged by log-sum-exp) on the block kernel, and every kernel this machine has
    (``block_kernel``'s choice and the matmul fallback) gives the same block output, log-sum-exp
    and gradients, causal and full, with grouped-query heads."""
    from gridshard.context.blocks import MATMUL, block_kernel
    g = torch.Generator().manual_seed(H)
    Q, K, V, G = (torch.randn(2, h, 24, 8, generator=g) for h in (H, H_kv, H_kv, H))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=H != H_kv).backward(G)
    q, k, v = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    out = ring_attention(q, k, v, _one_rank_axis())
    out.backward(G)
    ref = F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=H != H_kv)
    for mine, want in ((out, ref), (q.grad, Q.grad), (k.grad, K.grad), (v.grad, V.grad)):
        assert relative_error(mine, want) <= TOL
    kernel = block_kernel(Q)
    assert kernel.name == "cpu_flash"
    for causal in (True, False):          # a block with 12 queries against 12 keys; O, ℓ the block's own
        q, k, v, dO = Q[:, :, :12].detach(), K[:, :, 12:].detach(), V[:, :, 12:].detach(), G[:, :, :12]
        (o, lse), (o_ref, lse_ref) = (kern.forward(q, k, v, 0.3, causal) for kern in (kernel, MATMUL))
        assert relative_error(o, o_ref) <= TOL and relative_error(lse, lse_ref) <= TOL
        grads = kernel.backward(dO, q, k, v, o, lse, 0.3, causal)
        for mine, want in zip(grads, MATMUL.backward(dO, q, k, v, o_ref, lse_ref, 0.3, causal)):
            assert mine.shape == want.shape and relative_error(mine, want) <= TOL


def _peak_rise(n: int, H: int = 4, d: int = 16) -> int:
    """How far one ring forward + backward (C = 1, 2c = n tokens) lifts this process's peak RSS."""
    from gridshard.engine.memory_meter import process_peak_rss, rss_now
    q, k, v = (torch.randn(1, H, n, d).requires_grad_() for _ in range(3))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # Linux: resets VmHWM to the current RSS
    base = rss_now()
    ring_attention(q, k, v, _one_rank_axis()).sum().backward()
    return process_peak_rss() - base


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux peak-RSS reset")
def test_ring_block_product_holds_no_score_matrix():
    """The process peak of a ring forward + backward grows with the tokens, not with their square.

    One rank, 4 heads of 16, 2c = 1024 and 4096 tokens. The scores of one c × c block at
    2c = 4096 are 4·2048²·4 bytes = 64 MiB: above glibc's largest mmap threshold (32 MiB), so a
    block product that materialised them would map fresh pages the peak sees, whatever the heap
    earlier tests left (measured with the matmul block: 36 MiB at 1024 tokens, 192 MiB at 4096).
    On the kernel: 4 and 11 MiB — the k/v stacks, fp32 accumulators, block outputs and gradients of
    a few MiB each. Bound: the rise from 1024 to 4096 tokens stays under half of one block's scores,
    32 MiB."""
    _peak_rise(256)                                    # warm-up: thread pools, kernel buffers
    small, large = _peak_rise(1024), _peak_rise(4096)
    assert large - small < 32 * 2**20, (small, large)


def _cuda_kernel_cases(device, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, h, 40, 16, generator=g).to(device, dtype) for h in (4, 2, 2, 4))
    return q, k, v, dO


@pytest.mark.parametrize("name", ["cuda_flash", "cuda_efficient"])
def test_cuda_block_kernels_take_their_arguments(name):
    """Without a GPU: the CUDA kernels' argument lists parse and give the shapes the ring expects
    (meta tensors run PyTorch's shape functions of the same ops): O [b, H, n, d], ℓ [b, H, n]
    (the efficient kernel's padded rows cut), k/v gradients folded to H_kv heads."""
    from gridshard.context import blocks
    kernel = {k.name: k for k in (blocks.CUDA_FLASH, blocks.CUDA_EFFICIENT)}[name]
    q, k, v, dO = (t.to("meta") for t in _cuda_kernel_cases("cpu", torch.bfloat16))
    o, lse = kernel.forward(q, k, v, 0.25, True)
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    grads = kernel.backward(dO, q, k, v, o, lse, 0.25, False)
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_cuda_block_kernels_equal_the_matmul_blocks(dtype, tol):
    """On a GPU: ``block_kernel``'s CUDA choice against the fp32 matmul block, causal and full."""
    from gridshard.context.blocks import MATMUL, block_kernel
    q, k, v, dO = _cuda_kernel_cases("cuda", dtype)
    kernel = block_kernel(q)
    assert kernel.name == ("cuda_flash" if dtype == torch.bfloat16 else "cuda_efficient")
    for causal in (True, False):
        (o, lse), (o_ref, lse_ref) = (kern.forward(q, k, v, 0.25, causal) for kern in (kernel, MATMUL))
        assert relative_error(o, o_ref) <= tol and relative_error(lse, lse_ref) <= tol
        grads = kernel.backward(dO, q, k, v, o_ref.to(dtype), lse_ref, 0.25, causal)
        for mine, want in zip(grads, MATMUL.backward(dO, q, k, v, o_ref, lse_ref, 0.25, causal)):
            assert relative_error(mine, want) <= tol
