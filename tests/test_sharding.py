"""Shard specs: blocks cover the global tensor exactly once; fused parts stay together."""
import itertools

import pytest
import torch

from gridshard.errors import ShapeError
from gridshard.nn.sharding import ShardSpec, assemble_global, take_shard


def _all_blocks(full, spec, size):
    coords = sorted({c for _, c in spec.splits})
    blocks = []
    for combo in itertools.product(*(range(size[c]) for c in coords)):
        index = dict(zip(coords, combo))
        blocks.append((index, take_shard(full, spec, index, size)))
    return blocks


@pytest.mark.parametrize("spec,size", [
    (ShardSpec((12, 5), ((0, "tensor"),)), {"tensor": 4}),
    (ShardSpec((6, 8), ((0, "grid_row"), (1, "grid_col"))), {"grid_row": 2, "grid_col": 2}),
    (ShardSpec((18,), ((0, "grid_col"), (0, "grid_row"))), {"grid_row": 3, "grid_col": 3}),
    (ShardSpec((12, 4), ((0, "tensor"),), fused_parts=3), {"tensor": 2}),
])
def test_blocks_reassemble_to_global(spec, size):
    full = torch.randn(spec.global_shape)
    blocks = _all_blocks(full, spec, size)
    assert sum(b.numel() for _, b in blocks) == full.numel()
    assert torch.equal(assemble_global(blocks, spec, size), full)
    assert all(tuple(b.shape) == spec.local_shape(size) for _, b in blocks)


def test_fused_parts_keep_each_part_block_on_one_rank():
    # q|k|v each of 4 rows, T=2: rank 1 holds q rows 2-3, k rows 2-3, v rows 2-3
    full = torch.arange(12).reshape(12, 1)
    spec = ShardSpec((12, 1), ((0, "tensor"),), fused_parts=3)
    local = take_shard(full, spec, {"tensor": 1}, {"tensor": 2})
    assert local.flatten().tolist() == [2, 3, 6, 7, 10, 11]


def test_nested_bias_split_order():
    # 2D bias [out=8], q=2: rank (i, j) holds sub-block i of out-block j
    full = torch.arange(8)
    spec = ShardSpec((8,), ((0, "grid_col"), (0, "grid_row")))
    size = {"grid_row": 2, "grid_col": 2}
    assert take_shard(full, spec, {"grid_row": 1, "grid_col": 0}, size).tolist() == [2, 3]
    assert take_shard(full, spec, {"grid_row": 0, "grid_col": 1}, size).tolist() == [4, 5]


def test_indivisible_local_shape_names_the_rule():
    with pytest.raises(ShapeError, match="not divisible"):
        ShardSpec((10, 3), ((0, "tensor"),)).local_shape({"tensor": 4})
