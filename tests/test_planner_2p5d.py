"""The planner at 2.5D (issue 24): rank-free, each test well under a second.

* enumeration: 2.5D with every depth d ≥ 2 where T = q²·d, q ≥ 2; the layout carries ``tensor_depth``;
* pricing: a 2.5D layout is priced as the 2D layout each rank runs (``Layout.layer_layout``: q² ranks,
  m/d rows, D·d data replicas) — every step-time term equal to that layout's on one node, the SUMMA
  comm equal to :mod:`gridshard.tensor.tp2d.theory` on m/d rows (which :mod:`gridshard.tensor.tp2p5d.theory` states
  for each 2.5D layer), the gradient reduction over D·C·d ranks, the memory equal to
  :func:`gridshard.planner.fit.config_layout`'s of the config the planner writes, which validates;
* ``--explain``: says why 2.5D wins against 2D at the same T (fewer SUMMA calls on a grid that stays
  inside a node, against the depth reduction and the weights replicated d times).
"""
from gridshard.config import load_config, resolve_config
from gridshard.planner import evaluate, load_hardware
from gridshard.planner.cost_memory import layout_memory
from gridshard.planner.cost_time import rank_cost
from gridshard.planner.price_data import data_comm
from gridshard.planner.price_tensor import tensor_volumes
from gridshard.planner.fit import config_layout
from gridshard.planner.layouts import Layout, enumerate_layouts
from gridshard.planner.report import explain, written_config
from gridshard.planner.search import PlanResult
from gridshard.tensor.tp2d import theory as tp2d
from gridshard.tensor.tp2p5d import theory as tp2p5d

DEEP = Layout(1, 1, 8, "2.5d", False, 0, "none", 4, tensor_depth=2)          # q = 2, d = 2


def test_2p5d_enumerated_with_its_depth():
    at8 = list(enumerate_layouts(8, 16, recompute=("none",)))
    deep = [x for x in at8 if x.tensor_mode == "2.5d"]
    assert deep and {(x.tensor, x.tensor_depth) for x in deep} == {(8, 2)}
    assert {x.tensor_depth for x in at8 if x.tensor_mode != "2.5d"} == {1}
    assert deep[0].parallel_section()["tensor_depth"] == 2 and "2.5d d2" in deep[0].label()
    at16 = {(x.tensor_mode, x.tensor_depth) for x in enumerate_layouts(16, 16, recompute=("none",)) if x.tensor == 16}
    assert at16 == {("1d", 1), ("2d", 1), ("2.5d", 4)}                          # 16 = 4² = 2²·4
    assert DEEP.layer_layout() == Layout(2, 1, 4, "2d", False, 0, "none", 2)


def test_2p5d_priced_as_2d_on_m_over_d_rows():
    cfg = load_config("configs/tiny.yaml")
    mc, s, hw = cfg.model.resolve(), cfg.data.seq_len, load_hardware("cpu")
    deep = rank_cost(mc, DEEP, hw, seq_len=s, global_batch=16).latency
    layer = rank_cost(mc, DEEP.layer_layout(), hw, seq_len=s, global_batch=16).latency
    assert deep.as_dict() == layer.as_dict() and deep.details["tensor_depth"] == 2
    # the SUMMA comm of one decoder layer: 2D's block over the layer's m/d = 2 sequences
    vols = tensor_volumes(mc, DEEP.layer_layout(), s, 1, False, False)
    want = tp2d.total(tp2d.block2d_comm(2, s, mc.hidden, mc.ffn_hidden, 2, heads=mc.heads, kv_heads=mc.kv_heads))
    assert len(vols) == 1 and (vols[0].payload, vols[0].calls) == (want.payload, want.calls)
    # ... which is what theory.tp2p5d says each 2.5D layer moves on its grid (row/col), N/d tokens
    n = 4 * s
    lin = tp2p5d.linear2p5d_comm(n, mc.hidden, mc.ffn_hidden, 2, 2)
    flat = tp2d.linear2d_comm(n // 2, mc.hidden, mc.ffn_hidden, 2)
    assert all(lin[a].payload == flat[a].payload and lin[a].calls == flat[a].calls for a in ("row", "col"))
    # the depth sum is the reducer's: data × depth = 2 ranks, the rank's q² block
    reduce, _, _ = data_comm(mc, DEEP.layer_layout(), None, True, True, 1, 25 << 20)
    assert reduce.group_size == 2 and reduce.calls == {"all_reduce": 1}
    # fewer SUMMA calls than 2D on the same T = 16 (q = 2, d = 4 against q = 4)
    calls = lambda x: rank_cost(mc, x, hw, seq_len=s, global_batch=16).latency.details["tensor_calls_per_microbatch"]  # noqa: E731
    assert calls(Layout(1, 1, 16, "2.5d", False, 0, "none", 8, tensor_depth=4)) < \
        calls(Layout(1, 1, 16, "2d", False, 0, "none", 8))


def test_2p5d_written_config_validates_and_memory_is_the_launch_checks():
    cfg = load_config("configs/tiny.yaml")
    hw = load_hardware("cpu")
    cand = evaluate(cfg, DEEP, hw, 8)
    assert cand.feasible, cand.reason
    result = PlanResult([cand], [], cfg, hw, 8, 1, source="configs/tiny.yaml")
    written = resolve_config(written_config(result), world_size=8, cuda_available=False)
    assert (written.parallel.tensor_mode, written.parallel.tensor_depth, written.train.micro_batch) == ("2.5d", 2, 4)
    assert config_layout(written) == DEEP.layer_layout()
    mem, _ = layout_memory(cfg.model.resolve(), config_layout(written), cfg.data.seq_len, 16, hw.reserved_bytes,
                           hw.margin_fraction)
    assert mem.total == cand.memory.total
    bad = evaluate(cfg, Layout(1, 1, 8, "2.5d", False, 0, "none", 2, tensor_depth=2), hw, 8)
    assert not bad.feasible and "multiple of 4" in bad.reason                    # m = 2 < d·q rows


def test_explain_says_why_2p5d_wins_against_2d_at_the_same_t():
    """125M on 16 H100 over 2 nodes, T = 16: 2D's 4×4 grid spans both nodes, 2.5D's 2×2 grid stays
    inside one (depth outermost) and makes fewer SUMMA calls; it pays a depth reduction per step."""
    cfg = load_config("configs/gpt_125m.yaml", ["train.global_batch=16"])
    hw, nodes = load_hardware("h100"), 2
    deep = evaluate(cfg, Layout(1, 1, 16, "2.5d", False, 0, "selective", 8, tensor_depth=4), hw, 16, nodes)
    flat = evaluate(cfg, Layout(1, 1, 16, "2d", False, 0, "selective", 8), hw, 16, nodes)
    assert deep.feasible and flat.feasible and deep.predicted_step_s < flat.predicted_step_s
    assert deep.step.details["links"]["tensor"] == "intra" and flat.step.details["links"]["tensor"] == "inter"
    assert deep.step.data_comm_s > flat.step.data_comm_s == 0.0                 # the depth joins the reduction
    text = explain(PlanResult([deep, flat], [], cfg, hw, 16, nodes))
    assert "2.5D: D1 P1 T16 2.5d d4" in text and "is the best layout" in text
    assert "wins against D1 P1 T16 2d z0 rc=selective m8 at the same T" in text and "calls per micro-batch" in text
