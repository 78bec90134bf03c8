"""Shard specs: blocks cover the global tensor exactly once, in the documented order."""
import itertools
import math

import pytest
import torch

from gridshard.errors import ShapeError
from gridshard.nn.sharding import ShardSpec, assemble_global, take_shard
from gridshard.theory.zero import flat_range_boxes


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
])
def test_blocks_reassemble_to_global(spec, size):
    full = torch.randn(spec.global_shape)
    blocks = _all_blocks(full, spec, size)
    assert sum(b.numel() for _, b in blocks) == full.numel()
    assert torch.equal(assemble_global(blocks, spec, size), full)
    assert all(tuple(b.shape) == spec.local_shape(size) for _, b in blocks)


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


GRID = {"tensor": 4, "grid_row": 2, "grid_col": 2}


def _ranks(size):
    if "grid_row" in size:
        return [{"tensor": i * 2 + j, "grid_row": i, "grid_col": j} for i in range(2) for j in range(2)]
    return [{"tensor": t} for t in range(size["tensor"])]


@pytest.mark.parametrize("spec,size", [
    (ShardSpec((100, 3), ((0, "tensor"),), canonical_shape=(97, 3)), {"tensor": 4}),       # vocab rows, padded
    (ShardSpec((3, 98), ((0, "grid_row"), (1, "grid_col")), transposed=True, canonical_shape=(97, 3)), GRID),
    (ShardSpec((4, 6), ((0, "grid_row"), (1, "grid_col")), transposed=True), GRID),        # Linear2D [in, out]
    (ShardSpec((8,), ((0, "grid_col"), (0, "grid_row"))), GRID),                            # 2D norm piece
    (ShardSpec((8, 5), ((0, "tensor"),), replicate=2), {"tensor": 4}),                      # kv heads shared
    (ShardSpec((7, 2)), {"tensor": 2}),                                                     # replicated
])
def test_canonical_box_of_a_block_and_of_its_element_ranges(spec, size):
    """The box (and view) of a block, and of every element range [a, b) of it (a ZeRO shard: its
    boxes by :func:`flat_range_boxes`, rows and columns narrowed), hold exactly the canonical
    elements that :func:`take_shard` of the storage tensor puts there."""
    canon = torch.arange(1, 1 + torch.Size(spec.canonical()).numel()).reshape(spec.canonical())
    storage = spec.from_canonical(canon)                 # padding rows are 0
    for index in _ranks(size):
        local = take_shard(storage, spec, index, size)
        flat = local.reshape(-1)
        n = flat.numel()
        for a, b in [(a, b) for a in range(n) for b in range(a + 1, n + 1)]:
            pieces = flat_range_boxes(local.shape, a, b)
            for local_box, (lo, hi) in pieces:
                part = flat[lo:hi].view(tuple(h - l for l, h in local_box))
                box = spec.canonical_box(index, size, local_box=local_box)
                if box is None:
                    assert not part.any(), (index, a, b)    # only padding
                    continue
                want = canon[tuple(slice(o, o + n) for o, n in box)]
                assert torch.equal(spec.canonical_view(part, box), want), (index, a, b, box)
                assert int((part != 0).sum()) == want.numel()          # nothing outside the box but padding
        whole = tuple((0, m) for m in local.shape)
        assert spec.canonical_box(index, size) == spec.canonical_box(index, size, local_box=whole)


@pytest.mark.parametrize("shape", [(), (7,), (4, 5), (3, 4, 2), (2, 1, 3, 2)])
def test_flat_range_boxes_cover_each_element_once_in_order(shape):
    """Every element range of a block of ``shape`` decomposes into ≤ 2·ndim − 1 boxes that are,
    in order, exactly its elements, each box the contiguous flat slice it claims."""
    ids = torch.arange(math.prod(shape)).reshape(shape)
    n = ids.numel()
    for a in range(n):
        for b in range(a, n + 1):
            pieces = flat_range_boxes(shape, a, b)
            assert len(pieces) <= max(1, 2 * len(shape) - 1)
            got = []
            for box, (lo, hi) in pieces:
                part = ids[tuple(slice(l, h) for l, h in box)]
                assert part.reshape(-1).tolist() == list(range(lo, hi)), (shape, a, b, box)
                got += part.reshape(-1).tolist()
            assert got == list(range(a, b)), (shape, a, b)
