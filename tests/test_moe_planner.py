"""The planner on a Mixture-of-Experts model (issue 38; :mod:`gridshard.planner.price_expert`):

* enumeration: every E dividing gcd(experts, D·C·d), ``all_gather`` only where E ≤ k (beyond, it
  moves more bytes in more calls: checked on the closed form);
* the dispatch priced is the closed form of :mod:`gridshard.theory.moe` under balanced routing (the
  all-to-all's 2·h·b·N·k·(E − 1)/E each way, a full recompute adding the forward's share), on the
  expert group's link (inside a node while it fits there);
* compute: an MoE block's FLOPs repeat on the T tensor ranks, the rest is split; the MFU counts active FLOPs;
* the expert gradients are reduced over the D·C/E expert-data ranks, n/E experts each;
* Mixtral 8×7B on 64 H100 and a DeepSeek-V3-shaped model on 1024 H100: layouts with E > 1 that fit,
  and ``--explain`` says why.
"""
import dataclasses

import pytest

from gridshard.config import load_config
from gridshard.planner import evaluate, load_hardware, plan
from gridshard.planner.fit import config_layout
from gridshard.planner.layouts import Layout, enumerate_layouts, expert_choices
from gridshard.planner.price_compute import microbatch_flops
from gridshard.planner.price_data import data_comm
from gridshard.planner.price_expert import dispatch_volumes, moe_flops_per_token
from gridshard.planner.price_links import link_levels
from gridshard.planner.report import explain, written_config
from gridshard.theory.moe import balanced_dispatch_volume
from gridshard.theory.training import model_flops_per_token

TINY_MOE = ["model.experts=4", "model.experts_per_token=2", "model.kv_heads=2", "model.expert_ffn_hidden=88",
            "model.moe_every=2", "model.layers=4", "data.seq_len=64", "train.global_batch=16", "train.micro_batch=2"]


def test_expert_choices_and_enumeration():
    assert expert_choices(8, 4, 2) == [(1, "all_to_all"), (2, "all_to_all"), (2, "all_gather"), (4, "all_to_all")]
    assert expert_choices(6, 4, 2) == [(1, "all_to_all"), (2, "all_to_all"), (2, "all_gather")]
    assert [e for e, _ in expert_choices(1024, 256, 8)] == [1, 2, 2, 4, 4, 8, 8, 16, 32, 64, 128, 256]
    layouts = list(enumerate_layouts(8, 16, zero_stages=(1,), recompute=("none",), micro_batches=[2], experts=4,
                                     experts_per_token=2))
    for lay in layouts:
        assert 4 % lay.expert == 0 and lay.data * lay.context * lay.tensor_depth % lay.expert == 0
    assert {(x.expert, x.expert_dispatch) for x in layouts if x.data == 8} == set(expert_choices(8, 4, 2))
    # the all-gather moves more than the all-to-all once E > k (balanced routing, 2 bytes, h = 64, N = 512)
    for E, k in ((2, 2), (4, 2), (8, 2), (8, 8)):
        wire = {kind: sum(p for _, p in balanced_dispatch_volume(kind, E, 8, 512, 64, k, 2).values())
                for kind in ("all_to_all", "all_gather")}
        assert (wire["all_gather"] > wire["all_to_all"]) == (E > k) or E == k


def test_dispatch_priced_is_the_balanced_closed_form():
    cfg = load_config(None, TINY_MOE)
    mc = cfg.model.resolve()
    lay = Layout(4, 1, 1, "none", False, 1, "none", 2, expert=4)
    N, h, k, b = 2 * 64, mc.hidden, 2, 2
    moe_layers = 2                                           # layers 1 and 3 of 4 (moe_every 2)
    (vol,) = dispatch_volumes(mc, lay, 64, moe_layers, "bf16")
    assert vol.count("all_to_all_v") == 4 * moe_layers and vol.count("all_gather") == moe_layers
    assert vol.payload_bytes("all_to_all_v") == pytest.approx(moe_layers * 2 * h * b * 2 * N * k * 3 / 4, abs=8)
    full = dispatch_volumes(mc, dataclasses.replace(lay, recompute="full"), 64, moe_layers, "bf16")
    assert sum(v.count("all_to_all_v") for v in full) == 6 * moe_layers
    assert dispatch_volumes(mc, dataclasses.replace(lay, expert=1), 64, moe_layers, "bf16") == []
    # E consecutive replica ranks: inside a node of 8 while they fit (context innermost, then data over P·C·T)
    h100 = load_hardware("h100")
    assert link_levels(dataclasses.replace(lay, data=64, expert=8), h100, 8)["expert"] == "intra"
    assert link_levels(dataclasses.replace(lay, data=32, pipeline=2, expert=8), h100, 8)["expert"] == "inter"
    assert link_levels(dataclasses.replace(lay, data=8, context=8, expert=8), h100, 8)["expert"] == "intra"


def test_moe_compute_repeats_on_tensor_ranks_and_mfu_counts_active_flops():
    cfg = load_config(None, TINY_MOE)
    mc = cfg.model.resolve()
    one, two = (Layout(1, 1, T, "1d" if T > 1 else "none", False, 0, "none", 2) for T in (1, 2))
    f1, f2 = (microbatch_flops(mc, x, 64, 4, False, 2) for x in (one, two))
    moe = 2 * 2 * 64 * moe_flops_per_token(mc)              # 2 MoE layers × m·s tokens
    dense_mlp = 2 * 2 * 64 * 18 * mc.hidden * mc.ffn_hidden
    assert f2 == pytest.approx(moe + (f1 - moe + dense_mlp) / 2 - dense_mlp / 2)
    r = plan(None, 4, hardware="cpu", overrides=TINY_MOE + ["parallel.data=4"], zero_stages=(1,), max_micro_batch=2)
    assert r.best.flops_per_token == model_flops_per_token("llama", mc, 64)


def test_expert_gradients_reduced_over_the_expert_data_ranks():
    cfg = load_config(None, TINY_MOE)
    mc = cfg.model.resolve()
    for zero, op in ((0, "all_reduce"), (1, "reduce_scatter")):
        at = {E: Layout(4, 1, 1, "none", False, zero, "none", 2, expert=E) for E in (1, 2, 4)}
        dense1 = data_comm(mc, at[1], None, True, True, 1, 25 << 20)[0]
        dense2, _, _ = data_comm(mc, at[2], None, True, True, 1, 25 << 20)
        experts2, _, units = data_comm(mc, at[2], None, True, True, 1, 25 << 20, experts=True)
        assert experts2.group_size == 2 and dense2.group_size == 4 and units >= 1
        expert_bytes = 2 * 3 * mc.hidden * mc.expert_ffn_hidden * 2 * 4      # n/E = 2 experts, 2 MoE layers, fp32
        assert dense1.payload_bytes(op) - dense2.payload_bytes(op) == pytest.approx(2 * expert_bytes, rel=0.01)
        assert experts2.payload_bytes(op) == pytest.approx(expert_bytes, rel=0.01)
        assert data_comm(mc, at[4], None, True, True, 1, 25 << 20, experts=True)[0] is None   # D·C/E = 1


def test_small_moe_plan_explains_its_expert_choice_and_writes_a_valid_config(tmp_path):
    # the config's own parallel.expert (4) must not leak into the candidates with another E
    r = plan(None, 8, hardware="h100", overrides=TINY_MOE + ["parallel.data=8", "parallel.expert=4"],
             zero_stages=(0, 1), max_micro_batch=2)
    assert {c.layout.expert for c in r.candidates} >= {1, 2, 4}
    assert {c.layout.expert for c in r.candidates if c.layout.data * c.layout.context == 2} == {1, 2}
    text = explain(r)
    assert "experts: 4 per MoE layer, 2 active per token; E = " in text
    assert any(line.startswith("  E = ") for line in text.splitlines())
    e2 = next(c for c in r.candidates if c.layout.expert == 2)
    assert e2.layout.expert_dispatch in ("all_to_all", "all_gather") and e2.step.expert_comm_s > 0
    written = written_config(dataclasses.replace(r, candidates=[e2]))
    assert written["parallel"]["expert"] == 2
    load_config(written)


@pytest.mark.parametrize("name,gpus", [("mixtral_8x7b", 64), ("deepseek_v3", 1024)])
def test_published_moe_models_plan_expert_parallel_layouts(name, gpus):
    """Issue 38's check: Mixtral 8×7B on 64 H100 and the DeepSeek-V3-shaped config on 1024 H100 get
    feasible layouts with E > 1 (ZeRO-1 and micro-batch 1 only, to stay fast), and --explain says
    why; the config's own layout is among the feasible ones."""
    cfg = f"configs/{name}.yaml"
    r = plan(cfg, gpus, hardware="h100", zero_stages=(1,), max_micro_batch=1, max_context=1)
    fits = [c for c in r.candidates if c.layout.expert > 1]
    assert fits and all(c.memory.total_with_margin <= r.hardware.device_memory_bytes for c in fits)
    text = explain(r)
    assert "experts: " in text and " per MoE layer" in text
    own = evaluate(r.config, config_layout(r.config), r.hardware, gpus, r.nodes)
    assert own.feasible and own.layout.expert > 1 and own.step.expert_comm_s > 0
