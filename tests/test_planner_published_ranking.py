"""Issue 43: the planner ranks layouts as published measured sweeps do, and every packaged hardware
profile says where its link bandwidths come from.

Narayanan et al. 2021 (*Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM*), Fig. 13: (t, p) ∈ {(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)} on 64 A100 (8 DGX A100
nodes), global batch 32 and 128, micro-batch 1. The model is the one of Megatron-LM's
``examples/sc21/run_figure_13.sh`` (the script that produced the figure): 32 layers, hidden 20480,
128 heads (162.2B parameters), full ("uniform") recompute; 2021's rules — no sequence parallelism, no
distributed optimizer (ZeRO-0), 1F1B. Measured: (t, p) = (8, 8) is the fastest at both batch sizes
(the tensor group exactly filling one node), and throughput falls off on both sides of it — tensor parallelism across nodes (t = 16, 32) and a
deep pipeline's bubble (p = 16, 32). GPT's 4h GELU MLP is modelled by SwiGLU with f = 8h/3 rounded to a
multiple of T (``benchmarks/planner_published.py``: ``fig13_step``, the one home of the sweep's layout).
"""
from __future__ import annotations

import json
import os

import pytest

from gridshard.config import load_config
from gridshard.planner.hardware import HARDWARE_DIR, builtin_hardware, load_hardware
from gridshard.planner.layouts import Layout

from .published_runs import published_runs


@pytest.mark.parametrize("batch", [128, 32])
def test_narayanan_fig13_tensor_pipeline_sweep_ranks_as_measured(batch):
    """(8, 8) is the fastest; on each side of it a layout further from (8, 8) is slower (t = 4 before
    t = 2, t = 16 before t = 32), as in the figure at both of its batch sizes."""
    pub = published_runs()
    step = {tp: pub.fig13_step(*tp, batch) for tp in pub.FIG13}
    assert min(step, key=step.get) == (8, 8), step
    assert step[(8, 8)] < step[(4, 16)] < step[(2, 32)], step            # deeper pipelines: the bubble
    assert step[(8, 8)] < step[(16, 4)] < step[(32, 2)], step            # tensor groups across nodes


def test_a100_eight_way_all_reduce_prices_the_published_bus_bandwidth():
    """The issue's check: an 8-way all-reduce of a bf16 block inside a DGX A100 takes
    S·2(n − 1)/n / busbw with the published 230 GB/s (nccl-tests all_reduce_perf on 8 A100-SXM4), and
    across nodes a tensor group of 16 (8 per node, 8 HDR NICs) the published 192 GB/s, one member per
    node (one NIC) 24 GB/s."""
    from gridshard.planner.price_links import comm_seconds
    from gridshard.tensor.tp1d.cost import tensor_comm_1d
    from gridshard.theory import CommVolume

    hw = load_hardware("a100")
    S = 2048 * 20480 * 2                                                  # one bf16 block of the 162.2B model
    t = comm_seconds([CommVolume(8).add("all_reduce", S)], hw, "intra") - hw.link("intra", "all_reduce").latency_s
    assert S * 2 * 7 / 8 / t == pytest.approx(230e9)
    t16 = comm_seconds([CommVolume(16).add("all_reduce", S)], hw, "inter", ranks_per_node=8)
    assert S * 2 * 15 / 16 / (t16 - hw.link("inter", "all_reduce").latency_s) == pytest.approx(192e9)
    assert hw.link("inter", "all_reduce").bus_bandwidth(1) == pytest.approx(24e9)
    assert hw.link("inter", "all_reduce").bus_bandwidth(4) == pytest.approx(96e9)         # linear: a NIC each
    # a bf16 run's 1D activation collectives carry 2-byte elements (the compute dtype), fp32 runs 4
    cfg = load_config(None, ["model.preset=7b"]).model.resolve()
    lay = Layout(1, 1, 8, "1d", False, 0, "none", 1)
    two, four = (tensor_comm_1d(cfg, lay, 2048, 1, False, False, e)[0] for e in (2, 4))
    assert two.payload["all_reduce"] * 2 == four.payload["all_reduce"]


@pytest.mark.parametrize("name", builtin_hardware())
def test_every_packaged_profile_cites_its_link_bandwidths(name):
    """Every packaged profile has non-empty ``sources``, and one of them names where its link
    bandwidths come from: published nccl-tests figures (with their addresses) for the GPUs; for the
    CPU placeholder profile, that they were set by hand on the development machine."""
    with open(os.path.join(HARDWARE_DIR, f"{name}.json")) as f:
        raw = json.load(f)
    sources = raw.get("sources") or []
    assert sources and all(isinstance(s, str) and s.strip() for s in sources)
    text = " ".join(sources)
    if name == "cpu":
        assert "calibrate" in text and "link" in text.lower()
        return
    assert "nccl-tests" in text and "busbw" in text.lower()
    links = [s for s in sources if "https://github.com/NVIDIA/nccl" in s]
    assert links, "no published nccl-tests figure cited"
    gbs = {f"{b.bandwidth / 1e9:g} GB/s" for lv in load_hardware(name).links.values() for b in lv.values()}
    gbs |= {f"{v / 1e9:g} GB/s" for lv in load_hardware(name).links.values() for b in lv.values()
            for v in b.bandwidth_by_ranks_per_node.values()}
    for figure in gbs:                                  # every bandwidth in the file is a cited figure
        assert figure in text, (name, figure)
