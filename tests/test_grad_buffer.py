"""ZeRO-0's persistent gradient buffer (:mod:`gridshard.zero.grad_buffer`) on two data ranks fed
the same data (so the mean is the plain gradient, exactly): the gradient views tile the buffer in
parameter order, each bucket is the contiguous slice of its parameters' views, micro-batches
accumulate into it like plain autograd, and ``zero_grad`` zeroes it in place (re-attaching any
view that was dropped). At D = 1 there is no buffer: autograd's own gradients."""
import torch
import torch.distributed as dist
from torch import nn

from gridshard.mesh import Axis
from gridshard.testing import run_on_ranks
from gridshard.zero import DataParallelGradSync, build_reducer


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4), nn.Linear(4, 3, bias=False))


def _data_axis():
    n = dist.get_world_size()
    return Axis("data", n, dist.get_rank(), tuple(range(n)), dist.group.WORLD if n > 1 else None)


def _layout_body():
    model = _model()
    sync = build_reducer(model, _data_axis(), zero=0, bucket_bytes=4 * 20, overlap=True)
    assert isinstance(sync, DataParallelGradSync) and model.grad_reducer is sync
    (buffer,) = sync.buffers
    params = list(model.parameters())
    assert buffer.numel() == sum(p.numel() for p in params)
    offset = 0
    for p in params:                                   # parameter after parameter, no gap, no overlap
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert p.grad.storage_offset() == offset and p.grad.shape == p.shape
        offset += p.numel()
    assert len(sync.buckets) > 2
    for bucket, flat in zip(sync.buckets, sync.bucket_flats):
        assert flat.storage_offset() == bucket[0].grad.storage_offset()
        assert flat.numel() == sum(p.numel() for p in bucket)
    return sum(sync.bucket_elems()) == buffer.numel()


def _accumulate_body():
    model, plain = _model(), _model()
    sync = DataParallelGradSync(model, _data_axis(), bucket_bytes=4 * 20, overlap=True)
    (buffer,) = sync.buffers
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
        assert torch.equal(buffer, torch.cat([q.grad.reshape(-1) for q in plain.parameters()]))
    model.zero_grad(set_to_none=True)                  # someone drops the views ...
    sync.zero_grad()                                   # ... the reducer puts them back, zeroed
    assert all(p.grad is v for p, v in zip(model.parameters(), sync.views))
    return not buffer.any()


def test_gradient_views_tile_the_buffer_and_buckets_are_its_slices():
    assert all(run_on_ranks(2, _layout_body))


def test_micro_batches_accumulate_into_the_buffer_and_zero_grad_keeps_it():
    assert all(run_on_ranks(2, _accumulate_body))


def test_one_data_rank_keeps_autograds_own_gradients():
    model = _model()
    sync = DataParallelGradSync(model, Axis("data", 1, 0, (0,), None), overlap=True)
    assert sync.buffers == [] and all(p.grad is None for p in model.parameters())
    model[0](torch.randn(2, 6)).sum().backward()       # only the first layer gets a gradient
    sync.sync()
    assert all(p.grad is not None for p in model.parameters()) and not model[3].weight.grad.any()
    sync.zero_grad()
    assert all(p.grad is None for p in model.parameters())
