"""Counter-based init RNG: values depend only on (seed, key, global index), never on the
block layout, chunking or thread count; statistics of a standard normal."""
import math

import pytest
import torch

from gridshard.init import block_flat_indices, fill_normal_, key_hash, normal_at, uniform_at
from gridshard.init import counter_rng

SEED, KEY = 1234, "blocks.0.mlp.fc1.weight"
G = (6, 10)


def _fill(shape, rows, cols, dtype=torch.float32, **kw):
    out = torch.empty(len(rows), len(cols), dtype=dtype)
    return fill_normal_(out, SEED, KEY, shape, [torch.tensor(rows), torch.tensor(cols)], std=kw.pop("std", 1.0), **kw)


def test_blocks_assemble_to_full_tensor_bit_for_bit():
    full = _fill(G, range(6), range(10))
    assert torch.equal(full, normal_at(SEED, KEY, torch.arange(60)).reshape(G))
    assert torch.equal(full, normal_at(SEED, KEY, block_flat_indices(G, [torch.arange(6), torch.arange(10)])))
    layouts = {
        "row blocks": ([[0, 1], [2, 3], [4, 5]], [list(range(10))]),
        "column blocks": ([list(range(6))], [list(range(5)), list(range(5, 10))]),
        "unordered / strided grid": ([[0, 3, 1], [5, 2, 4]], [[0, 2, 4, 6, 8], [9, 7, 5, 3, 1]]),
    }
    for name, (row_parts, col_parts) in layouts.items():
        assembled = torch.full(G, float("nan"))
        for rows in row_parts:
            for cols in col_parts:
                assembled[torch.tensor(rows)[:, None], torch.tensor(cols)] = _fill(G, rows, cols)
        assert torch.equal(assembled, full), name          # also: every element written (no NaN)


def test_non_contiguous_out_and_other_dtypes():
    rows, cols = torch.tensor([4, 0, 2]), torch.tensor([1, 8, 3, 5])
    want64 = normal_at(SEED, KEY, block_flat_indices(G, [rows, cols]), std=0.5, dtype=torch.float64)
    out = torch.zeros(4, 3, dtype=torch.float64).t()         # a transposed (non-contiguous) view
    assert not out.is_contiguous()
    assert fill_normal_(out, SEED, KEY, G, [rows, cols], std=0.5) is out
    assert torch.equal(out, want64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = fill_normal_(torch.empty(3, 4, dtype=dtype), SEED, KEY, G, [rows, cols], std=0.5)
        assert torch.equal(got, want64.to(dtype)), dtype    # one rounding from float64


@pytest.mark.parametrize("chunk", [1, 3, 5, 6, 7, 24, 25, 119, 120, 1 << 22])
def test_chunk_size_does_not_change_values(chunk):
    shape = (5, 4, 6)
    ix = [torch.tensor([4, 0, 2, 3]), torch.tensor([3, 1]), torch.tensor([0, 5, 2, 1, 4])]
    ref = normal_at(SEED, KEY, block_flat_indices(shape, ix), std=0.02, mean=0.1)
    got = fill_normal_(torch.empty(4, 2, 5), SEED, KEY, shape, ix, std=0.02, mean=0.1, chunk_elems=chunk)
    assert torch.equal(got, ref)


def test_value_does_not_depend_on_position_in_call():
    # an element alone (scalar/SIMD-tail code paths) equals the same element inside a long call
    idx = torch.arange(100_003)
    ref = normal_at(SEED, KEY, idx, dtype=torch.float64)
    for i in [0, 1, 7, 8, 15, 4095, 65535, 65536, 99_999, 100_002]:
        assert torch.equal(normal_at(SEED, KEY, idx[i:i + 1], dtype=torch.float64), ref[i:i + 1])
        assert torch.equal(normal_at(SEED, KEY, idx[i:i + 3], dtype=torch.float64), ref[i:i + 3])


def test_thread_count_does_not_change_values():
    idx = torch.arange(70_000)            # > torch's grain size: ops split across threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = normal_at(SEED, KEY, idx)
        torch.set_num_threads(2)
        two = normal_at(SEED, KEY, idx)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_chunks_bound_the_temporaries(monkeypatch):
    """Every chunk's int64 flat-index temporary has at most chunk_elems elements."""
    sizes = []
    real_flat = counter_rng._flat

    def recording_flat(*a, **kw):
        f = real_flat(*a, **kw)
        sizes.append(f.numel())
        return f

    monkeypatch.setattr(counter_rng, "_flat", recording_flat)
    rows, cols = torch.arange(8), torch.arange(10)
    ref = normal_at(SEED, KEY, block_flat_indices((8, 10), [rows, cols]))
    sizes.clear()
    got = fill_normal_(torch.empty(8, 10), SEED, KEY, (8, 10), [rows, cols], std=1.0, chunk_elems=25)
    assert sizes == [20, 20, 20, 20] and torch.equal(got, ref)   # 2 whole rows per chunk
    sizes.clear()
    got = fill_normal_(torch.empty(3, 10), SEED, KEY, (8, 10), [rows[:3], cols], std=1.0, chunk_elems=4)
    assert sizes == [4, 4, 2] * 3 and torch.equal(got, ref[:3])  # a row is too big: split it
    sizes.clear()
    fill_normal_(torch.empty(8, 10), SEED, KEY, (8, 10), [rows, cols], std=1.0)
    assert sizes == [80]                                          # default: one chunk


def test_same_key_and_seed_repeat_other_keys_and_seeds_differ():
    idx = torch.arange(10_000)
    a = normal_at(SEED, KEY, idx)
    assert torch.equal(a, normal_at(SEED, KEY, idx.clone()))
    for other in [normal_at(SEED + 1, KEY, idx), normal_at(SEED, KEY + "x", idx),
                  normal_at(SEED, "blocks.0.mlp.fc2.weight", idx), normal_at(-SEED, KEY, idx)]:
        assert (a == other).float().mean() < 0.01
        assert abs(float(torch.corrcoef(torch.stack([a, other]))[0, 1])) < 0.05
    assert key_hash(SEED, KEY) == key_hash(SEED, KEY) != key_hash(SEED, KEY + "x")
    assert 0 <= key_hash(SEED, KEY) < 2 ** 63


GOLDEN_KEY_HASH = 8497906744521052214
GOLDEN_NORMALS = ["-0x1.16b7b5ff85820p+0", "0x1.a504c18888864p-1", "0x1.38b5fc4f3c656p-1",
                  "-0x1.89b4e954b7ea6p-4", "0x1.b518c7f1f2eb5p-1"]


def test_golden_values_are_stable():
    """Pinned values: a change here silently changes every run's initial model (and a
    process-salted hash such as Python's hash() would not reproduce them)."""
    assert key_hash(0, "w") == GOLDEN_KEY_HASH
    got = normal_at(0, "w", torch.tensor([0, 1, 2, 2 ** 32, 2 ** 63 - 1]), dtype=torch.float64)
    assert [v.hex() for v in got.tolist()] == GOLDEN_NORMALS


def test_standard_normal_statistics():
    z = normal_at(7, "stats", torch.arange(1_000_000), dtype=torch.float64)
    assert abs(float(z.mean())) < 0.01
    assert abs(float(z.std()) - 1) < 0.01
    assert 0.0020 <= float((z.abs() > 3).double().mean()) <= 0.0034    # 2·Φ(-3) = 0.0027
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([z[:-1000], z[1000:]]))[0, 1])) < 0.01  # next row
    # quantiles match the normal's to within the sampling error
    p = torch.tensor([0.001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999], dtype=torch.float64)
    assert torch.allclose(torch.quantile(z[:200_000], p), torch.special.ndtri(p), atol=0.04)
    assert float(z.abs().max()) < math.sqrt(66 * math.log(2))       # u ≥ 2**-33


def test_box_muller_matches_torch_log_and_cos():
    idx = torch.arange(200_000)
    u0, u1 = uniform_at(3, "bm", idx, stream=0), uniform_at(3, "bm", idx, stream=1)
    assert 0 < float(u0.min()) and float(u0.max()) < 1 and abs(float(u0.mean()) - 0.5) < 0.005
    assert abs(float(torch.corrcoef(torch.stack([u0, u1]))[0, 1])) < 0.01
    ref = torch.sqrt(-2 * torch.log(u0)) * torch.cos(2 * math.pi * u1)
    assert float((normal_at(3, "bm", idx, dtype=torch.float64) - ref).abs().max()) < 1e-12
    # the edges of the integer folding in cos and of the mantissa folding in log
    cells = torch.tensor([1, 3, 2 ** 31 - 1, 2 ** 31 + 1, 2 ** 32 - 1, 2 ** 32 + 1, 2 ** 33 - 3, 2 ** 33 - 1])
    u = cells.double() * 2.0 ** -33
    assert float((counter_rng._cos_2pi(cells) - torch.cos(2 * math.pi * u)).abs().max()) < 1e-15
    u = torch.cat([u, torch.tensor([0.5, math.sqrt(0.5), math.nextafter(math.sqrt(0.5), 0), 0.75],
                                   dtype=torch.float64)])
    assert float(((counter_rng._log(u) - torch.log(u)) / torch.log(u)).abs().max()) < 1e-15


def test_std_and_mean_are_applied():
    idx = torch.arange(100_000)
    z = normal_at(SEED, KEY, idx, dtype=torch.float64)
    scaled = normal_at(SEED, KEY, idx, std=0.02, mean=3.0, dtype=torch.float64)
    assert torch.equal(scaled, z * 0.02 + 3.0)
    assert abs(float(scaled.mean()) - 3.0) < 0.001 and abs(float(scaled.std()) - 0.02) < 0.001
    out = fill_normal_(torch.empty(100, 1000), SEED, KEY, (100, 1000), [torch.arange(100), torch.arange(1000)],
                       std=0.02, mean=3.0, chunk_elems=3000)
    assert torch.equal(out.reshape(-1), (z * 0.02 + 3.0).float())


def test_indices_beyond_2_pow_32():
    idx = torch.tensor([0, 1, 7, 2 ** 32, 2 ** 32 + 1, 2 ** 32 + 7, 2 ** 33, 5 * 2 ** 32 + 7,
                        2 ** 40 + 5, 2 ** 62, 2 ** 63 - 1])
    z = normal_at(SEED, KEY, idx, dtype=torch.float64)
    assert torch.isfinite(z).all() and z.unique().numel() == idx.numel()
    # the high half is mixed in: i and i + 2**32 are unrelated
    n = 100_000
    low = normal_at(SEED, KEY, torch.arange(n), dtype=torch.float64)
    high = normal_at(SEED, KEY, torch.arange(n) + 2 ** 32, dtype=torch.float64)
    assert abs(float(torch.corrcoef(torch.stack([low, high]))[0, 1])) < 0.02
    assert abs(float(high.mean())) < 0.02 and abs(float(high.std()) - 1) < 0.02
    # a shard of a global tensor with 2**35 elements, without materialising the tensor
    shape = (4, 2 ** 33)
    ix = [torch.tensor([3, 1]), torch.tensor([2 ** 33 - 1, 5, 2 ** 32])]
    flat = block_flat_indices(shape, ix)
    assert flat.tolist() == [[3 * 2 ** 33 + c for c in (2 ** 33 - 1, 5, 2 ** 32)],
                             [2 ** 33 + c for c in (2 ** 33 - 1, 5, 2 ** 32)]]
    got = fill_normal_(torch.empty(2, 3, dtype=torch.float64), SEED, KEY, shape, ix, std=1.0, chunk_elems=2)
    assert torch.equal(got, normal_at(SEED, KEY, flat, dtype=torch.float64))


def test_block_flat_indices_and_scalars():
    assert block_flat_indices((6, 10), [torch.tensor([0, 3, 1]), torch.tensor([2, 9])]).tolist() == \
        [[2, 9], [32, 39], [12, 19]]
    assert block_flat_indices((2, 3, 4), [torch.tensor([1]), torch.tensor([2, 0]), torch.tensor([3])]).tolist() == \
        [[[23], [15]]]
    assert block_flat_indices((), []).shape == ()
    scalar = fill_normal_(torch.empty(()), SEED, "scale", (), [], std=1.0)
    assert torch.equal(scalar, normal_at(SEED, "scale", torch.tensor(0)))
    empty = fill_normal_(torch.empty(0, 10), SEED, KEY, G, [torch.tensor([], dtype=torch.long), torch.arange(10)], std=1.0)
    assert empty.shape == (0, 10)


@pytest.mark.parametrize("call, err", [
    (lambda: block_flat_indices(G, [torch.arange(6)]), ValueError),                         # one list per dim
    (lambda: block_flat_indices(G, [torch.arange(6), torch.tensor([10])]), ValueError),      # out of range
    (lambda: fill_normal_(torch.empty(2, 3), 0, "w", G, [torch.arange(3), torch.arange(3)], 1.0), ValueError),
    (lambda: fill_normal_(torch.empty(1, 1), 0, "w", G, [[0], [0]], 1.0, chunk_elems=0), ValueError),
    (lambda: normal_at(0, "w", torch.tensor([-1])), ValueError),
    (lambda: normal_at(0, "w", torch.tensor([1], dtype=torch.int32)), TypeError),
    (lambda: key_hash(0.5, "w"), TypeError),
])
def test_bad_arguments_are_rejected(call, err):
    with pytest.raises(err):
        call()
