"""ZeRO-0's persistent gradient buffers (:class:`gridshard.zero.ZeroDataParallel` at stage 0) on two
data ranks fed the same data (so the mean is the plain gradient, exactly): the buckets are units of
consecutive parameters, each with one flat buffer its gradient views tile in parameter order,
micro-batches accumulate into them like plain autograd, and ``zero_grad`` zeroes them in place
(re-attaching any view that was dropped). At D = 1 there is no buffer: autograd's own gradients."""
import torch
import torch.distributed as dist
from torch import nn

from gridshard.mesh import Axis
from gridshard.testing import run_on_ranks
from gridshard.zero import ZeroDataParallel, build_reducer


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4), nn.Linear(4, 3, bias=False))


def _data_axis():
    n = dist.get_world_size()
    return Axis("data", n, dist.get_rank(), tuple(range(n)), dist.group.WORLD if n > 1 else None)


def _layout_body():
    model = _model()
    sync = build_reducer(model, _data_axis(), zero=0, bucket_bytes=4 * 20, overlap=True)
    assert isinstance(sync, ZeroDataParallel) and sync.stage == 0 and model.grad_reducer is sync
    assert len(sync.units) > 2 and sync.norm_axis is None
    params = list(model.parameters())
    assert [p for u in sync.units for p in u.params] == params       # consecutive, in model order
    for u in sync.units:                               # parameter after parameter, no gap, no overlap
        numel = sum(p.numel() for p in u.params)
        assert u.grad_buffer.numel() == numel and (numel <= 20 or len(u.params) == 1)
        offset = 0
        for p in u.params:
            assert p.grad.untyped_storage().data_ptr() == u.grad_buffer.untyped_storage().data_ptr()
            assert p.grad.storage_offset() == offset and p.grad.shape == p.shape
            offset += p.numel()
    return all(s.tensor is s.param and s.elements is None for s in sync.stepped())


def _accumulate_body():
    model, plain = _model(), _model()
    sync = ZeroDataParallel(model, _data_axis(), 0, bucket_bytes=4 * 20, overlap=True)
    buffer = lambda: torch.cat([u.grad_buffer for u in sync.units])     # noqa: E731
    torch.manual_seed(1)                               # the same data on both ranks
    xs = [torch.randn(3, 6) for _ in range(3)]
    for step in range(2):
        sync.zero_grad()
        plain.zero_grad(set_to_none=True)
        for i, x in enumerate(xs[step:]):
            if i == len(xs[step:]) - 1:
                sync.arm()
            model(x).square().sum().backward()
            plain(x).square().sum().backward()
        sync.sync()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert torch.equal(buffer(), torch.cat([q.grad.reshape(-1) for q in plain.parameters()]))
    model.zero_grad(set_to_none=True)                  # someone drops the views ...
    sync.zero_grad()                                   # ... the reducer puts them back, zeroed
    assert all(p.grad is v for u in sync.units for p, v in zip(u.params, u.grad_views))
    return not buffer().any()


def test_buckets_are_consecutive_units_whose_gradient_views_tile_their_buffers():
    assert all(run_on_ranks(2, _layout_body))


def test_micro_batches_accumulate_into_the_buffer_and_zero_grad_keeps_it():
    assert all(run_on_ranks(2, _accumulate_body))


def test_one_data_rank_keeps_autograds_own_gradients():
    model = _model()
    sync = ZeroDataParallel(model, Axis("data", 1, 0, (0,), None), 0, overlap=True)
    assert all(u.grad_buffer.numel() == 0 for u in sync.units) and all(p.grad is None for p in model.parameters())
    model[0](torch.randn(2, 6)).sum().backward()       # only the first layer gets a gradient
    sync.sync()
    assert all(p.grad is not None for p in model.parameters()) and not model[3].weight.grad.any()
    sync.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_bf16_buckets_hold_the_fp32_master_gradient_instead_of_the_bf16_buffer():
    """bf16 storage at ZeRO-0 (one data rank: still reduced, into fp32): from ``sync`` to
    ``after_step`` each bucket holds its fp32 master gradient (4 bytes per element) in place of its
    bf16 gradient buffer (2), so the reducer's buffers go from 2 + 2 + 4 (params, grads, masters)
    to 2 + 4 + 4 bytes per element and back — the 18Ψ step peak with AdamW's 8 (module docstring)."""
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    sync = build_reducer(model, Axis("data", 1, 0, (0,), None), zero=0, bucket_bytes=4 * 20, overlap=False,
                         param_dtype=torch.bfloat16)
    held = lambda: sum(t.untyped_storage().nbytes() for u in sync.units                       # noqa: E731
                       for t in (u.param_buffer, u.grad_buffer, u.reduced, u.master))
    assert len(sync.units) > 2 and held() == (2 + 2 + 4) * n
    model(torch.randn(3, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    want = [p.grad.float() for p in model.parameters()]
    sync.sync()
    assert held() == (2 + 4 + 4) * n and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(m.grad, g) for (_, m), g in zip(sync.optimizer_tensors(), want))
    sync.after_step()
    assert held() == (2 + 2 + 4) * n
    sync.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
