"""The planner and the memory model at 3D (issue 24). make test: rank-free, each test a second or two.

* enumeration: ``3d`` wherever T = q³ (q ≥ 2), never with sequence parallelism; the config rules keep
  the layouts whose model and micro-batch fit the cube (hidden % q³, heads and kv heads % q, ffn % q²,
  micro-batch % q²);
* pricing: a decoder layer's tensor comm per cube axis equals :func:`gridshard.tensor.tp3d.theory.block3d_comm`
  (whose ring bytes are the per-linear closed form plus the norms, split over ``input`` / ``output`` by each
  projection's orientation, by hand), the model's ends and full recompute
  their theory functions, each axis priced on its own link (``output`` innermost, the last to leave a
  node), compute 1/T of one device's FLOPs, stage sends the [m/q², s, h/q] block;
* memory: parameters 1/T of one device's, equal to a model laid out at 3D on the meta device; the
  activations per layer the 3D formula (N/q² token rows, H/q heads, f/q neurons), a tied head's copy of its
  weight slice by hand; the written config
  validates and the launch check prices it alike; wide: the memory model and
  ``tensor_comm_3d`` of the whole model (tied and untied) against the tensors and the ledger of 8 real ranks;
* ``--explain``: names 3D's place against 2D / 2.5D at the same T and why it wins (Llama 7B on 64 H100
  over 8 nodes: the q = 4 cube moves more bytes than the 4×4×4 2.5D layout, but fewer across nodes —
  its ``output`` axis stays inside one — and beats the 8×8 grid).
"""
import math

import pytest
import torch

from gridshard.config import load_config, resolve_config
from gridshard.mesh import ShapeMesh
from gridshard.models.llama import Transformer
from gridshard.parallel import parallelize
from gridshard.planner import evaluate, load_hardware
from gridshard.planner.cost_memory import layout_memory
from gridshard.planner.cost_time import rank_cost
from gridshard.planner.price_compute import microbatch_flops
from gridshard.planner.price_context import context_comm
from gridshard.planner.price_links import comm_seconds, link_levels
from gridshard.planner.price_tensor import tensor_volumes
from gridshard.tensor.tp3d.cost import cube_axis_levels, tensor_comm_3d
from gridshard.planner.fit import config_layout
from gridshard.planner.layouts import Layout, enumerate_layouts, layout_problem
from gridshard.planner.report import explain, written_config
from gridshard.planner.search import PlanResult
from gridshard.tensor.tp3d.tied_head import tied_head_extra_bytes
from gridshard.tensor.tp3d import theory as tp3d
from gridshard.theory.context import ring_block_bytes
from gridshard.theory.vocab import padded_vocab_size
from gridshard.theory.memory import activation_bytes, layer_saved_bytes
from gridshard.theory.pipeline import boundary_bytes

CUBE = Layout(1, 1, 8, "3d", False, 0, "none", 4)          # q = 2, m/q² = 1 sequence per rank


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k].group_size, a[k].calls, a[k].payload) ==
                                        (b[k].group_size, b[k].calls, b[k].payload) for k in a)


def test_3d_enumerated_where_t_is_a_cube_and_the_rules_keep_the_valid_ones():
    modes = lambda world, t: {(x.tensor_mode, x.sequence_parallel, x.tensor_depth)  # noqa: E731
                              for x in enumerate_layouts(world, 16, zero_stages=(0,), recompute=("none",),
                                                         micro_batches=[4]) if x.tensor == t}
    assert ("3d", False, 1) in modes(8, 8) and ("3d", False, 1) in modes(27, 27)
    assert ("3d", True, 1) not in modes(8, 8)                              # sequence parallelism never in effect
    assert not {m for m, _, _ in modes(16, 16) | modes(4, 4) | modes(32, 32)} & {"3d"}
    cfg = load_config("configs/tiny.yaml")                                 # h=64, H=K=4, f=176, V=256
    assert layout_problem(cfg, CUBE, 8) is None
    assert "q²" in layout_problem(cfg, Layout(1, 1, 8, "3d", False, 0, "none", 2), 8)     # m=2: not 4 batch blocks
    bad = {"model.ffn_hidden=170": "ffn_hidden", "model.hidden=60": "hidden", "model.kv_heads=1": "kv_heads"}
    for override, field in bad.items():
        problem = layout_problem(load_config("configs/tiny.yaml", [override]), CUBE, 8)
        assert problem and field in problem, (override, problem)
    assert layout_problem(cfg, Layout(1, 1, 27, "3d", False, 0, "none", 9), 27)           # 64 % 27: hidden
    assert layout_problem(cfg, Layout(1, 1, 8, "3d", False, 0, "none", 4, context=2), 16) is None   # C = 2 at 3D


def test_3d_priced_from_its_theory_axis_by_axis():
    cfg = load_config("configs/tiny.yaml", ["model.kv_heads=2"])
    mc, s, hw = cfg.model.resolve(), cfg.data.seq_len, load_hardware("h100")
    h, f, q, m = mc.hidden, mc.ffn_hidden, 2, CUBE.micro_batch
    layer = tensor_comm_3d(mc, CUBE, s, 1, False, False)
    want = tp3d.block3d_comm(m, s, h, f, q, heads=mc.heads, kv_heads=mc.kv_heads)
    assert _same(layer, want) and tp3d.rounds(layer) == 4 * 8 + 2 * 4    # 4 products × 8 calls + 2 norms × 4
    # the block's ring bytes: four Linear3D closed forms (q|k|v and gate|up each one product of the joined
    # width: the norm output gathered once) plus two norms (statistics and weight vectors)
    n, kv = m * s, mc.kv_heads * mc.head_dim
    linears = [(h, h + 2 * kv), (h, h), (h, 2 * f), (f, h)]
    norms = 2 * ((q - 1) / q * 2 * 2 * n // q ** 2 * 4 + 2 * (q * q - 1) / (q * q) * h // q * 4)
    assert math.isclose(tp3d.wire_bytes(layer), sum(tp3d.linear3d_wire_bytes(n, i, o, q) for i, o in linears) + norms)
    # ... on their orientations' axes: q|k|v and gate|up read the residual layout (X gathered twice and dX
    # scattered on input, Y scattered and dY gathered on output); o and down, built on the swapped one, the reverse
    col, row = [linears[k] for k in (0, 2)], [linears[k] for k in (1, 3)]
    by_hand = lambda reads, writes: {  # noqa: E731
        "all_gather": sum(2 * n * i // q ** 2 * 4 for i, _ in reads) + sum(n * o // q ** 2 * 4 for _, o in writes),
        "reduce_scatter": sum(n * i // q ** 2 * 4 for i, _ in reads) + sum(n * o // q ** 2 * 4 for _, o in writes)}
    assert dict(layer["input"].payload) == by_hand(col, row)
    assert {k: layer["output"].payload[k] for k in ("all_gather", "reduce_scatter")} == by_hand(row, col)
    # the whole model (both ends on this rank) and full recompute
    assert _same(tensor_comm_3d(mc, CUBE, s, mc.layers, True, True),
                 tp3d.combine(tp3d.ends3d_comm(m, s, h, mc.vocab_size, q), *[want] * mc.layers))
    # a tied head (both ends on the rank): the embedding's table gathered over the residual batch axis
    tied = load_config("configs/tiny.yaml", ["model.kv_heads=2", "model.tie_embeddings=true"]).model.resolve()
    ends = lambda c: tensor_comm_3d(c, CUBE, s, 0, True, True)["weight_input"].payload  # noqa: E731
    extra = tied_head_extra_bytes(padded_vocab_size(mc.vocab_size, q * q), h, q)
    assert {k: ends(tied)[k] - ends(mc).get(k, 0) for k in ends(tied)} == extra
    full = Layout(1, 1, 8, "3d", False, 0, "full", 4)
    assert _same(tensor_comm_3d(mc, full, s, 1, False, False),
                 tp3d.combine(want, tp3d.block3d_recompute_comm(m, s, h, f, q, heads=mc.heads, kv_heads=mc.kv_heads)))
    # priced: every axis on its own link (one node: all intra), A micro-batches, nothing else in tensor comm
    st = rank_cost(mc, CUBE, hw, seq_len=s, global_batch=16).latency
    vols = tensor_volumes(mc, CUBE, s, mc.layers, True, True)
    assert math.isclose(st.tensor_comm_s, st.details["micro_batches"] * comm_seconds(vols, hw, "intra"))
    assert set(st.details["links"]["tensor_axes"].values()) == {"intra"}
    # which axes leave a node: output (q consecutive ranks) last, then input (q²), then the rest
    assert cube_axis_levels(4, 64, 8) == {"output": "intra", "input": "inter", "weight": "inter",
                                          "weight_input": "inter", "weight_output": "inter"}
    assert cube_axis_levels(2, 16, 4) == {"output": "intra", "input": "intra", "weight": "inter",
                                          "weight_input": "inter", "weight_output": "inter"}
    assert link_levels(Layout(2, 1, 8, "3d", False, 0, "none", 4), hw, 2)["tensor_axes"]["weight"] == "intra"
    # compute: 1/T of one device's FLOPs; stage sends: the [m/q², s, h/q] block
    one = Layout(1, 1, 1, "none", False, 0, "none", 4)
    assert math.isclose(microbatch_flops(mc, CUBE, s, mc.layers, True) * 8, microbatch_flops(mc, one, s, mc.layers, True))
    assert boundary_bytes("3d", False, 8, 4, s, h) == (4 // 4) * s * (h // 2) * 4
    # context parallelism (C = 2, ring): the k/v blocks of the rank's m/q² sequences and K/q kv heads
    ring, _ = context_comm(mc, Layout(1, 1, 8, "3d", False, 0, "none", 4, context=2), s, 1, "fp32")
    assert ring.payload["send"] == 2 * ring_block_bytes(4 // 4, s // 2, mc.kv_heads // q, mc.head_dim, 4) + \
        2 * ring_block_bytes(4 // 4, s // 2, mc.kv_heads // q, mc.head_dim, 4)      # (C − 1) fwd + bwd, C grads


def test_3d_memory_is_one_over_t_and_the_meta_model_s():
    cfg = load_config("configs/tiny.yaml")
    mc, s = cfg.model.resolve(), cfg.data.seq_len
    mem, _ = layout_memory(mc, CUBE, s, 16)
    one, _ = layout_memory(mc, Layout(1, 1, 1, "none", False, 0, "none", 4), s, 16)
    assert mem.params * 8 == one.params and mem.grads * 8 == one.grads
    # the parameters of a model laid out at 3D on the meta device, every tensor rank alike
    for t in (0, 5):
        with torch.device("meta"):
            plain = Transformer(mc)
        model = parallelize(plain, ShapeMesh(tensor=8, tensor_mode="3d", tensor_rank=t), device="meta")
        assert mem.params == 4 * sum(p.numel() for p in model.parameters())
    # ... which is tp3d's 1/T per block + the ends (V = 256 needs no padding at q = 2)
    h, f, V = mc.hidden, mc.ffn_hidden, mc.vocab_size
    assert mem.params == mc.layers * tp3d.block3d_param_bytes(h, f, 2, heads=mc.heads, kv_heads=mc.kv_heads) + \
        4 * (2 * V * h + h) // 8
    # activations per layer: N/q² token rows, H/q heads, f/q neurons, the residual N·h/q³ (fp32, no recompute)
    N, q, d = CUBE.micro_batch * s, 2, mc.head_dim
    Nr, Hr, Kr, fr, R = N // 4, mc.heads // q, mc.kv_heads // q, f // q, N * h // 8
    norm = 2 * R * 4 + Nr * 4 + h // q * 4
    want = 2 * norm + Nr * d * (2 * Hr + 2 * Kr) * 4 + Nr * Hr * 4 + 3 * Nr * fr * 4
    assert layer_saved_bytes(mc, "3d", 8, False, N) == mem.details["per_layer"] == want
    assert layer_saved_bytes(mc, "3d", 8, False, N, "full") == R * 4
    # a tied head keeps one more tensor: its product's copy of the weight slice [V_p/q, h/q²] (V_p = 256)
    tied = load_config("configs/tiny.yaml", ["model.tie_embeddings=true"]).model.resolve()
    head = lambda c: activation_bytes(c, CUBE.micro_batch, s, "3d", 8).head_and_loss  # noqa: E731
    assert head(tied) - head(mc) == V // q * h // q ** 2 * 4
    # --write: the written config validates at 3D and the launch check prices it as the planner did
    hw = load_hardware("cpu")
    cand = evaluate(cfg, CUBE, hw, 8)
    result = PlanResult([cand], [], cfg, hw, 8, 1, source="configs/tiny.yaml")
    written = resolve_config(written_config(result), world_size=8, cuda_available=False)
    assert (written.parallel.tensor_mode, written.parallel.tensor) == ("3d", 8) and config_layout(written) == CUBE
    assert layout_memory(mc, config_layout(written), s, 16, hw.reserved_bytes, hw.margin_fraction)[0].total == \
        cand.memory.total


def test_explain_says_why_3d_wins_against_2d_and_2p5d_at_the_same_t():
    """Llama 7B on 64 H100 over 8 nodes, T = 64: the q = 4 cube's traffic falls as 1/q² and only its
    ``output`` axis stays inside a node; the 8×8 grid and the 4×4×4 2.5D layout move more."""
    cfg = load_config("configs/llama_7b.yaml", ["train.global_batch=16"])
    hw, nodes = load_hardware("h100"), 8
    cands = [evaluate(cfg, Layout(1, 1, 64, mode, False, 0, "selective", 16, tensor_depth=d), hw, 64, nodes)
             for mode, d in (("3d", 1), ("2.5d", 4), ("2d", 1))]
    assert all(c.feasible for c in cands), [c.reason for c in cands]
    cube, deep, flat = cands
    assert cube.predicted_step_s < deep.predicted_step_s < flat.predicted_step_s
    assert cube.memory.params < deep.memory.params                        # 1/T against 1/q² (d replicas)
    text = explain(PlanResult(cands, [], cfg, hw, 64, nodes))
    assert "3D: D1 P1 T64 3d z0 rc=selective m16 (q = 4" in text and "is the best layout" in text
    assert "cube axes across nodes: input, weight, weight_input, weight_output" in text
    assert "wins against D1 P1 T64 2.5d d4 z0 rc=selective m16 at the same T" in text and "across nodes" in text



def _tiny(tied: bool):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=96, max_seq_len=16,
                       tie_embeddings=tied)


CASES = [(tied, p, r) for tied in (False, True) for p in ("fp32", "bf16") for r in ("none", "selective", "full")
         if not tied or r == "none"]


def _measure_3d(cases):
    """On each of the 8 ranks of a q = 2 cube, per (tied, precision, recompute): the bytes one forward
    saves for backward (:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters excluded)
    and, for fp32 without recompute, the ledger's (calls, payload) per (axis, op) of that forward and
    its backward and the model-state bytes after one AdamW step."""
    from gridshard import build_mesh
    from gridshard.comm.ledger import CommLedger
    from gridshard.engine.memory_meter import SavedTensorMeter, model_state_tensor_bytes
    from gridshard.engine.optim import build_optimizer
    from gridshard.parallel.recompute import apply_recompute

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (4, 8), generator=g)
    targets = torch.randint(0, 97, (4, 8), generator=g)
    out = {}
    for tied, precision, recompute in cases:
        with torch.device("meta"):
            plain = Transformer(_tiny(tied))
        ledger = CommLedger()
        model = parallelize(plain, build_mesh(1, 1, 8, "3d", ledger=ledger), seed=0, device="cpu")
        apply_recompute(model, recompute)
        ctx = model.parallel_context
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        ledger.reset()
        with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
            loss = ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_targets(targets), reduction="sum")
        out[tied, precision, recompute] = meter.bytes
        if (precision, recompute) == ("fp32", "none"):
            loss.backward()
            out[tied, "ledger"] = {(e.axis, e.op): (e.count, e.payload_bytes) for e in ledger.entries.values()}
            opt = build_optimizer(model, 1e-3, 0.1)
            opt.step()
            out[tied, "state"] = model_state_tensor_bytes(model, opt)
    return out


@pytest.mark.wide
def test_3d_memory_model_equals_the_tensors_of_eight_ranks():
    """theory.memory and theory.tp3d at 3D against a real q = 2 cube (8 ranks): the saved-for-backward
    bytes of one forward in every recompute mode, fp32 and bf16 (untied; tied without recompute), the
    ledger of one forward + backward (= ``tensor_comm_3d`` of the whole model, tied and untied), and the model state
    after one AdamW step (parameters, gradients, optimizer), on every rank."""
    from gridshard.parallel.rank_blocks import rank_parameter_blocks
    from gridshard.testing import run_on_ranks
    from gridshard.theory.memory import model_state_bytes

    got = run_on_ranks(8, _measure_3d, CASES)
    for tied, precision, recompute in CASES:
        want = activation_bytes(_tiny(tied), 4, 8, "3d", 8, False, recompute, precision=precision).total
        assert [r[tied, precision, recompute] for r in got] == [want] * 8, (tied, precision, recompute, want)
    for tied in (False, True):
        # the ledger of one forward + backward: the theory the planner prices with, per axis and op
        vol = tensor_comm_3d(_tiny(tied), CUBE, 8, 2, True, True)        # m = 4, s = 8, both ends, 2 layers
        want = {(a, op): (v.calls[op], v.payload[op]) for a, v in vol.items() for op in v.calls}
        assert all(r[tied, "ledger"] == want for r in got), (tied, got[0][tied, "ledger"], want)
        state = model_state_bytes(rank_parameter_blocks(_tiny(tied), "3d", 8), zero=0)
        for r in got:
            assert (r[tied, "state"]["params"], r[tied, "state"]["grads"], r[tied, "state"]["optimizer"]) == \
                (state.params, state.grads, state.optimizer), tied
