"""Mesh layout: validation before any process group, coordinates from DeviceMesh."""
import pytest
import torch.distributed as dist

from gridshard.errors import LayoutError
from gridshard.mesh import build_mesh, factorizations, validate_layout
from gridshard.testing import run_on_ranks


def test_product_must_equal_world_size_and_error_lists_valid_layouts():
    with pytest.raises(LayoutError) as e:
        validate_layout(8, data=2, pipeline=1, tensor=3)
    msg = str(e.value)
    assert "2×1×3 = 6" in msg and "world size is 8" in msg and "(D=2, P=1, T=4)" in msg


def test_non_square_2d_names_nearest_squares():
    with pytest.raises(LayoutError) as e:
        validate_layout(8, data=1, pipeline=1, tensor=8, tensor_mode="2d")
    assert "tensor=8" in str(e.value) and "tensor=4" in str(e.value) and "tensor=9" in str(e.value)


@pytest.mark.parametrize("bad,message", [
    (dict(data=0), r"parallel\.data=0 is invalid: every parallel size must be an integer >= 1"),
    (dict(tensor=-1), r"parallel\.tensor=-1 is invalid: every parallel size must be an integer >= 1"),
    (dict(tensor_mode="4d"), r"tensor_mode='4d' is unknown: it must be one of \('none', '1d', '2d', '2\.5d', '3d'\)\. Fix:"),
    (dict(tensor_mode="none", tensor=2), r"tensor_mode='none' with tensor=2: without tensor parallelism T must "
                                         r"be 1\. Fix: set tensor_mode to '1d' or '2d', or tensor=1"),
], ids=["data=0", "tensor=-1", "mode=3d", "none-with-T2"])
def test_bad_fields(bad, message):
    """Each bad field fails with its own message (the value and the rule), not just the type."""
    kw = dict(data=1, pipeline=1, tensor=2, tensor_mode="1d")
    kw.update(bad)
    with pytest.raises(LayoutError, match=message):
        validate_layout(2 if kw["tensor"] == 2 else 1, **kw)


def test_factorizations():
    assert sorted(factorizations(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert factorizations(8, pipeline=1, square_tensor=True) == [(8, 1, 1), (2, 1, 4)]


def _coords_1d():
    m = build_mesh(data=2, pipeline=1, tensor=2)
    assert build_mesh(data=2, pipeline=1, tensor=2) is m  # cached, no new groups
    return dist.get_rank(), m.data.rank, m.tensor.rank, m.tensor.ranks, m.data.ranks


def test_1d_mesh_coordinates_tensor_innermost():
    res = run_on_ranks(4, _coords_1d)
    for rank, d, t, tranks, dranks in res:
        assert rank == d * 2 + t
        assert tranks == (d * 2, d * 2 + 1)
        assert dranks == (t, 2 + t)


def _coords_2d():
    m = build_mesh(data=1, pipeline=1, tensor=4, tensor_mode="2d")
    return dist.get_rank(), m.grid_row, m.grid_col, m.row.ranks, m.col.ranks, m.tensor.rank


def test_2d_grid_row_and_col_groups():
    for rank, i, j, row, col, t in run_on_ranks(4, _coords_2d):
        assert t == rank == i * 2 + j
        assert row == (i * 2, i * 2 + 1)      # same grid row, varying column
        assert col == (j, 2 + j)              # same grid column, varying row


def test_3d_tensor_size_names_the_cubes():
    with pytest.raises(LayoutError, match=r"tensor=9 with tensor_mode='3d'.*T must be q³ with q >= 2 \(valid: 8, 27, "
                                          r"64, 125, \.\.\.\)\. Fix: use tensor=8"):
        validate_layout(9, data=1, pipeline=1, tensor=9, tensor_mode="3d")
    validate_layout(16, data=2, pipeline=1, tensor=8, tensor_mode="3d")


def _coords_3d():
    from gridshard.comm import CommLedger

    m = build_mesh(tensor=8, tensor_mode="3d")
    again = build_mesh(tensor=8, tensor_mode="3d", ledger=CommLedger())
    assert build_mesh(tensor=8, tensor_mode="3d") is m                      # memoised, no new groups
    assert all(again.cube.physical[n].group is a.group for n, a in m.cube.physical.items())
    c = m.cube
    return (dist.get_rank(), m.tensor.rank, c.coords(), {n: a.ranks for n, a in c.physical.items()},
            (m.batch_blocks, m.batch_index, m.logits_batch_index), m.data_context.size, m.q)


@pytest.mark.wide                   # 8 ranks: make test-all
def test_3d_cube_dims_and_groups():
    """Dims (data, pipeline, weight, input, output): t = (i·q + j)·q + l; the weight axis is the q ranks
    4 apart, input 2 apart, output adjacent; batch (weight × input) and its swapped twin; tokens block
    i·q + j, targets block i·q + l; every weight split, so the reducer's group is data alone."""
    for rank, t, c, ranks, batch, dc, q in run_on_ranks(8, _coords_3d):
        i, j, l = rank // 4, (rank // 2) % 2, rank % 2
        assert t == rank and c == {"weight": i, "input": j, "output": l} and q is None
        assert ranks["weight"] == (j * 2 + l, 4 + j * 2 + l) and ranks["input"] == (4 * i + l, 4 * i + 2 + l)
        assert ranks["output"] == (4 * i + 2 * j, 4 * i + 2 * j + 1)
        assert ranks["weight_input"] == tuple(a * 4 + b * 2 + l for a in range(2) for b in range(2))
        assert ranks["weight_output"] == tuple(a * 4 + j * 2 + b for a in range(2) for b in range(2))
        assert batch == (4, 2 * i + j, 2 * i + l) and dc == 1


def test_outer_dims_are_declared_once():
    """The mesh builds the outer dims gridshard.mesh_dims declares: data and pipeline always, context
    and depth only above 1; parameters replicated (gradients reduced) along data, context, depth."""
    from gridshard.mesh_dims import outer_layout, weight_replica_dims
    assert outer_layout({"data": 2, "pipeline": 1}) == (("data", 2), ("pipeline", 1))
    assert outer_layout({"data": 1, "pipeline": 2, "context": 2, "depth": 2}) == \
        (("data", 1), ("pipeline", 2), ("context", 2), ("depth", 2))
    assert outer_layout({"context": 1, "depth": 3}) == (("data", 1), ("pipeline", 1), ("depth", 3))
    assert weight_replica_dims(("data", "pipeline", "context", "depth", "grid_row")) == ("data", "context", "depth")
    import importlib
    from gridshard.mesh_dims import OUTER_DIMS
    for dim in OUTER_DIMS:                      # each dim's named cost home exists (no stale pointer)
        importlib.import_module(dim.cost)
