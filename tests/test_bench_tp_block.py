"""``benchmarks/bench_tp_block.py``: the decoder block at 1D, 1D+SP, 2D (q=2, D=2), 2.5D (q=2, d=2)
and 3D (q=2; laid out by ``parallelize`` and, as a cross-check that must agree in bytes and
memory, from the 3D layer family directly) on 8 ranks, at the script's smallest shape (b=4, s=8,
h=64, 8 heads over 4 kv heads, f=128), one interleaved round.

Asserted for every mode: the output, the input gradient and every parameter gradient within
1e-5 relative of the single-device block on the same global weights and inputs; the ledger's
wire bytes and calls per rank equal the theory (``theory_volume``: the tp1d / tp2d / tp2p5d /
tp3d formulas, with the 2D and 2.5D gradient sum over their 2 weight replicas); parameters per
rank equal ``theory_param_bytes``, exactly 1/T of one device's at 3D and 1/q² at 2D and 2.5D;
saved activations per rank against one device on the same global batch within 1.1× the table:
2D 1/(D·q²), 2.5D 1/(d·q²), 3D 1/q³.
The 8-rank case is wide (starting 8 workers alone takes longer than `make test` allows); the
shape refusal runs in `make test`.
"""
import pytest

from benchmarks import bench_tp_block as bench
from gridshard.testing import run_on_ranks

SMALL = ["--batch", "4", "--seq", "8", "--hidden", "64", "--heads", "8", "--kv-heads", "4", "--ffn", "128",
         "--rounds", "1", "--modes", *bench.LAYOUTS]


def test_a_shape_some_mode_cannot_lay_out_is_refused_naming_the_size_and_a_fix():
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--batch", "6"])
    assert "--batch=6" in str(e.value) and "multiple of 4" in str(e.value) and "Fix" in str(e.value)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--kv-heads", "3", "--heads", "24"])
    assert "--kv-heads=3" in str(e.value)


@pytest.mark.wide
def test_every_mode_matches_one_device_and_its_bytes_follow_the_theory():
    a = bench.parse_args(SMALL)
    rows = {r["mode"]: r for r in bench.summarize(run_on_ranks(bench.WORLD, bench.measure, a, timeout=600), a)}
    assert set(rows) == {"1 dev", *bench.LAYOUTS}
    one = rows["1 dev"]
    for mode in bench.LAYOUTS:
        r = rows[mode]
        assert r["theory_ok"], (mode, r["wire"], r["calls"], r["theory_wire"], r["theory_calls"])
        assert r["max_err"] < 1e-5, (mode, r["errors"])
        assert len(r["errors"]) == 2 + 9, (mode, sorted(r["errors"]))        # y, dx, 9 parameter gradients
        assert r["params"] == bench.theory_param_bytes(mode, a), mode
        assert r["wire"] > 0 and r["peak"] > 0 and r["saved"] > 0
    assert rows["3d"]["params"] * bench.Q ** 3 == one["params"]
    for key in ("wire", "calls", "saved", "peak", "params"):      # parallelize's 3D = the layer family's
        assert rows["3d"][key] == rows["3d-layers"][key], key
    for mode in ("2d", "2.5d"):
        assert rows[mode]["params"] * bench.Q ** 2 == one["params"]
    for mode in ("2d", "2.5d", "3d"):
        table = bench.PREDICTED[mode]                  # 1/(D·q²), 1/(d·q²), 1/q³
        assert rows[mode]["saved_ratio"] <= 1.1 * table, (mode, rows[mode]["saved_ratio"], table)
