"""The per-rank memory model (:mod:`gridshard.theory.memory`) against the real laid-out model.

* parameter blocks: :func:`rank_parameter_blocks` (read from a one-layer model laid out on
  the meta device over a shape-only mesh) lists exactly the local shapes that
  ``gridshard.parallelize`` gives each rank of a real mesh with all its layers (none, 1D with
  split and replicated kv heads, 2D, tied and untied), pipeline ranks included, and a layer
  added to the model is in it;
* model state at ZeRO-0: the bytes of parameters, gradients and AdamW state after a real
  optimizer step equal :func:`model_state_bytes` exactly;
* ZeRO-1/2/3: the table of the module docstring on a hand-computed example, and its
  invariants (D = 1 is stage 0; optimizer shards add up to the whole);
* activations: the bytes autograd saves during one forward (counted by
  :class:`gridshard.engine.memory_meter.SavedTensorMeter`) equal :func:`activation_bytes`
  exactly, for recompute none / selective / full at T = 1 and on 2 and 4 ranks in 1D,
  1D + SP and 2D, in fp32 and under bf16 autocast on CPU (activations in bf16, autocast's
  weight copies included).
"""
import pytest
import torch

from gridshard.job_layout import StageSplit
from gridshard.parallel.rank_blocks import rank_parameter_blocks
from gridshard.testing import run_on_ranks
from gridshard.theory import memory as M


def tiny_config(tied=False, kv_heads=2):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=kv_heads, ffn_hidden=96,
                       max_seq_len=16, tie_embeddings=tied)


BATCH, SEQ = 4, 8
PRECISIONS = ("fp32", "bf16")                                    # bf16: CPU autocast, parameters fp32
PIPELINE_RANKS = (((0,), True, False), ((1,), False, True))      # (layer ids, first stage, last stage)

LAYOUTS = {  # name: (T, mode, sequence_parallel, tied, kv_heads)
    "T1-none": (1, "none", False, False, 2),
    "T1-1d-tied": (1, "1d", False, True, 4),
    "T2-1d": (2, "1d", False, False, 2),
    "T2-1d-SP-tied": (2, "1d", True, True, 2),
    "T4-1d-SP-kv-replicated": (4, "1d", True, False, 2),
    "T4-2d-tied-gqa": (4, "2d", False, True, 2),
}


def _measure(T, mode, sp, tied, kv):
    """On each rank: its parameter (name, shape) list, the model-state bytes after one AdamW
    step, and the saved-for-backward bytes of one forward per (precision, recompute mode)."""
    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter, model_state_tensor_bytes
    from gridshard.engine.optim import build_optimizer
    from gridshard.models import Transformer
    from gridshard.parallel.recompute import apply_recompute
    from gridshard.pipeline.split import RankModel

    cfg = tiny_config(tied, kv)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    out = {"saved": {}}
    for precision, recompute in [(p, r) for p in PRECISIONS for r in ("none", "selective", "full")]:
        with torch.device("meta"):
            plain = Transformer(cfg)
        model = parallelize(plain, build_mesh(1, 1, T, mode), sequence_parallel=sp, seed=0, device="cpu")
        apply_recompute(model, recompute)
        ctx = model.parallel_context
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
            loss = ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
        out["saved"][precision, recompute] = meter.bytes
        if (precision, recompute) == ("fp32", "none"):
            loss.backward()
            opt = build_optimizer(model, 1e-3, 0.1)
            opt.step()
            out["state"] = model_state_tensor_bytes(model, opt)
            out["params"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    out["stages"] = {}
    for ids, first, last in PIPELINE_RANKS:             # a pipeline rank's part, laid out on the same mesh
        with torch.device("meta"):
            plain = Transformer(cfg)
        part = parallelize(RankModel(plain, ids, first, last), build_mesh(1, 1, T, mode), seed=0, device="cpu")
        out["stages"][(ids, first, last)] = [(n, tuple(p.shape)) for n, p in part.named_parameters()]
    return out


_RESULTS: dict = {}


def measured(name):
    if name not in _RESULTS:
        T, mode, sp, tied, kv = LAYOUTS[name]
        _RESULTS[name] = run_on_ranks(T, _measure, T, mode, sp, tied, kv)
    return _RESULTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameter_blocks_are_the_laid_out_shapes(name):
    T, mode, sp, tied, kv = LAYOUTS[name]
    expected = [(b.name, b.shape) for b in rank_parameter_blocks(tiny_config(tied, kv), mode, T)]
    for rank, got in enumerate(measured(name)):
        assert sorted(got["params"]) == sorted(expected), f"{name} rank {rank}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_rank_blocks_are_the_laid_out_shapes(name):
    """A first-only and a last-only pipeline rank (tied: the last holds the embedding's table)."""
    T, mode, sp, tied, kv = LAYOUTS[name]
    for ids, first, last in PIPELINE_RANKS:
        expected = [(b.name, b.shape) for b in rank_parameter_blocks(tiny_config(tied, kv), mode, T, ids, first, last)]
        for rank, got in enumerate(measured(name)):
            assert sorted(got["stages"][(ids, first, last)]) == sorted(expected), f"{name} rank {rank} {ids}"


def test_a_layer_added_to_the_model_is_in_the_blocks(monkeypatch):
    """The blocks come from the model as built: a parameterised module added to every decoder
    layer appears in them (mode none: every layer, its own shape); under 1D, where the plan has
    no rule for it, the memory model refuses as ``parallelize`` does instead of leaving it out."""
    from torch import nn

    from gridshard.errors import LayoutError
    from gridshard.models import Transformer
    from gridshard.models import llama

    init = llama.DecoderLayer.__init__

    def with_adapter(self, cfg, index=0):
        init(self, cfg, index)
        self.adapter = nn.Linear(cfg.hidden, 3, bias=False)

    monkeypatch.setattr(llama.DecoderLayer, "__init__", with_adapter)
    cfg = tiny_config()
    with torch.device("meta"):
        plain = Transformer(cfg)
    blocks = rank_parameter_blocks(cfg, "none", 1)
    assert sorted((b.name, b.shape) for b in blocks) == sorted((n, tuple(p.shape)) for n, p in plain.named_parameters())
    assert [b.layer for b in blocks if b.name.endswith("adapter.weight")] == list(range(cfg.layers))
    with pytest.raises(LayoutError, match="adapter"):
        rank_parameter_blocks(cfg, "1d", 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero0_model_state_equals_the_tensors_after_a_step(name):
    T, mode, sp, tied, kv = LAYOUTS[name]
    state = M.model_state_bytes(rank_parameter_blocks(tiny_config(tied, kv), mode, T), zero=0)
    for rank, got in enumerate(measured(name)):
        assert got["state"]["params"] == state.params, (name, rank)
        assert got["state"]["grads"] == state.grads, (name, rank)
        assert got["state"]["optimizer"] == state.optimizer, (name, rank)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_saved_activation_bytes_equal_the_formula(name, recompute, precision):
    T, mode, sp, tied, kv = LAYOUTS[name]
    formula = M.activation_bytes(tiny_config(tied, kv), BATCH, SEQ, mode, T, sp, recompute, precision=precision).total
    for rank, got in enumerate(measured(name)):
        assert got["saved"][precision, recompute] == formula, \
            (f"{name} rank {rank} recompute={recompute} {precision}: measured {got['saved'][precision, recompute]} B, "
             f"formula {formula} B")


# per layer, 1D + SP, in s·b·h/t bytes (terms in 1/h, 1/d dropped): module docstring §2's table
@pytest.mark.parametrize("precision,recompute,units", [
    ("bf16", "none", 4 + 4 + 8 + 16), ("bf16", "selective", 4 + 8 + 32 / 3), ("bf16", "full", 2),
    ("fp32", "none", 24 + 16 + 32), ("fp32", "selective", 16 + 16 + 64 / 3), ("fp32", "full", 4)])
def test_layer_bytes_next_to_korthikanti(precision, recompute, units):
    """The GPT-3 175B shape with f = 8h/3 and K = H (h 12288, a 96), s 2048, b 1, t 8, SP: norms'
    x and y (+ x̂ in fp32; selective: y rebuilt), q/k/v/attention output, SwiGLU's 3 (g, u and the
    product, silu(g) rebuilt from g in every mode; 2 selective: the product rebuilt) f-wide
    tensors; bf16 selective 2/3 of Korthikanti et
    al.'s 34·s·b·h/t (they keep the norm outputs and both GELU tensors), full recompute equal to
    their 2·s·b·h/t."""
    from gridshard.models import ModelConfig

    cfg = ModelConfig(vocab_size=51200, hidden=12288, layers=96, heads=96, ffn_hidden=32768, max_seq_len=2048)
    s, b, t = 2048, 1, 8
    unit = s * b * cfg.hidden / t
    per_layer = M.layer_saved_bytes(cfg, "1d", t, True, s * b, recompute, e=M.activation_element_bytes(precision))
    assert per_layer / unit == pytest.approx(units, abs=0.05)
    if precision == "bf16" and recompute == "full":
        assert per_layer == pytest.approx(2 * unit, rel=0.10)
    if precision == "bf16" and recompute == "selective":
        assert per_layer < 34 * unit * 0.7


def test_recompute_orders_the_activations():
    """full < selective < none, and full keeps one residual block per layer."""
    cfg = tiny_config()
    a = {r: M.activation_bytes(cfg, BATCH, SEQ, "1d", 2, True, r) for r in ("none", "selective", "full")}
    assert a["full"].total < a["selective"].total < a["none"].total
    assert a["full"].per_layer == BATCH * SEQ * cfg.hidden // 2 * 4


# --- ZeRO stages on a hand-computed example -------------------------------------------------
# blocks: a [5, 3] matrix of layer 0, a [4] vector of layer 0, a [7, 2] root table; D = 2.
# unit layer 0: n = 15 + 4 = 19 → L = 20, C = 10; rank 1 owns [10, 20): elements 10..14 of the
# matrix and all 4 of the vector → s = 9, two stepped parameters. Root: n = 14 → L = 14, C = 7;
# rank 1 owns [7, 14) of the table → s = 7, one stepped parameter.
BLOCKS = [((5, 3), 0), ((4,), 0), ((7, 2), None)]
N_ALL, L_ALL, C_ALL, S_RANK1, COUNTERS = 15 + 4 + 14, 20 + 14, 10 + 7, 9 + 7, 4 * 3


@pytest.mark.parametrize("zero,params,grads,opt,buffers,transient", [
    (0, 4 * N_ALL, 4 * N_ALL, 8 * N_ALL + COUNTERS, 0, 0),
    (1, 4 * L_ALL, 4 * L_ALL, 8 * S_RANK1 + COUNTERS, 4 * C_ALL, 0),
    (2, 4 * L_ALL, 4 * C_ALL, 8 * S_RANK1 + COUNTERS, 0, 0),
    # the root gathered (4·14) + layer 0 gathered into its buffer (4·20)
    (3, 4 * C_ALL, 4 * C_ALL, 8 * S_RANK1 + COUNTERS, 0, 4 * 14 + 4 * 20),
])
def test_zero_stages_by_hand(zero, params, grads, opt, buffers, transient):
    st = M.model_state_bytes(BLOCKS, zero=zero, data=2, data_rank=1)
    assert (st.params, st.grads, st.optimizer, st.comm_buffers, st.transient) == \
        (params, grads, opt, buffers, transient)


def test_zero_invariants_on_the_tiny_model():
    blocks = rank_parameter_blocks(tiny_config(), "1d", 2)
    z0 = M.model_state_bytes(blocks, zero=0)
    for zero in (1, 2, 3):
        one = M.model_state_bytes(blocks, zero=zero, data=1)
        assert (one.params, one.grads, one.optimizer) == (z0.params, z0.grads, z0.optimizer), zero
    D = 4
    shards = [M.model_state_bytes(blocks, zero=1, data=D, data_rank=r, step_counters=False) for r in range(D)]
    assert sum(s.optimizer for s in shards) == 8 * sum(b.numel for b in blocks)
    z3 = M.model_state_bytes(blocks, zero=3, data=D)
    assert z3.params < z0.params / D * 1.1 and z3.held < z0.held / 3


def test_pipeline_stage_holds_its_in_flight_microbatches():
    cfg = tiny_config()
    stage0 = rank_parameter_blocks(cfg, layer_ids=StageSplit.of(cfg.layers, 2).rank_layer_ids(0), has_head=False)
    kw = dict(micro_batch=2, seq_len=8, n_microbatches=8, pipeline=2, blocks=stage0)
    first = M.predict_rank_memory(cfg, pipeline_rank=0, **kw)
    one = M.activation_bytes(cfg, 2, 8, layers=1, has_head=False)
    # each micro-batch in flight adds its own; the RoPE tables (the model's cache) are held once
    assert first.details["in_flight"] == 2 and first.activations == 2 * one.per_microbatch + one.rope_tables
    assert one.total == one.per_microbatch + one.rope_tables and one.rope_tables == 2 * 8 * cfg.head_dim * 4
    gpipe = M.predict_rank_memory(cfg, pipeline_rank=0, schedule="gpipe", **kw)
    assert gpipe.activations == 8 * one.per_microbatch + one.rope_tables
    assert first.params == 4 * sum(b.numel for b in rank_parameter_blocks(cfg, layer_ids=[0], has_head=False))


def test_prediction_adds_baseline_and_margin():
    cfg = tiny_config()
    pred = M.predict_rank_memory(cfg, micro_batch=2, seq_len=8, baseline_bytes=1000, blocks=rank_parameter_blocks(cfg))
    state = M.model_state_bytes(rank_parameter_blocks(cfg), 0)
    acts = M.activation_bytes(cfg, 2, 8).total + M.logits_workspace_bytes(cfg, 2, 8)
    assert pred.total == 1000 + state.held + acts
    # the margin covers what the step allocates and frees again, not the model state laid out once
    assert pred.total_with_margin == pred.total + int(0.1 * acts) == pred.total + int(0.1 * pred.churning)


def test_zero_backward_gradient_transient_by_hand():
    """Units: layer 0 = 5·3 + 4 = 19 elements, layer 1 = 6·2 = 12, root = 7·2 = 14; D = 2:
    gradient buffers L = 20, 12, 14 elements. One micro-batch: the root's buffer and up to three
    layers' (one filling, two reducing); two: every buffer from the first backward to the last."""
    blocks = [((5, 3), 0), ((4,), 0), ((6, 2), 1), ((7, 2), None)]
    assert M.zero_gradient_transient(blocks, 1, 2) == 0                    # ZeRO-1 keeps full grads anyway
    assert M.zero_gradient_transient(blocks, 2, 2) == 4 * (14 + 20 + 12)
    assert M.zero_gradient_transient(blocks, 3, 2, micro_batches=2, sharded_accumulation=False) == 4 * (20 + 12 + 14)
    wide = [((8,), i) for i in range(5)] + [((3,), None)]                  # five layers: three of them count
    assert M.zero_gradient_transient(wide, 3, 2, micro_batches=4) == 4 * (4 + 3 * 8)      # reduced per micro-batch
    assert M.zero_gradient_transient(wide, 3, 2, micro_batches=4, sharded_accumulation=False) == 4 * (4 + 5 * 8)
    assert M.zero_gradient_transient(wide, 2, 2) == 4 * (4 + 3 * 8)
    # ZeRO-3 gathers: the root and two consecutive layers (one computing, the next prefetched)
    assert M.model_state_bytes(blocks, zero=3, data=2).transient == 4 * 14 + 4 * (20 + 12)


def test_pipeline_reduction_cast_counts_after_the_backward():
    """bf16 storage, ZeRO-1, fp32 reduce: each unit in flight is cast to fp32 for its reduce-scatter
    (4·(L_root + three largest layers)). Without a pipeline that happens in the last backward, on
    top of the activations; with one (the reducer is not armed) in sync(), after the schedule's
    backward freed them: only what exceeds the freed activations counts."""
    cfg = tiny_config()
    blocks = rank_parameter_blocks(cfg, layer_ids=[0], has_head=False)
    cast = M.zero_reduce_cast_bytes(blocks, 1, 2, param_bytes=2, reduce_bytes=4)
    units = M.zero_units(blocks)
    from gridshard.theory.zero import unit_padded_numel
    L = {u: unit_padded_numel([b.numel for b in bs], 2) for u, bs in units.items()}
    assert cast == 4 * (L["root"] + L[0]) and M.zero_reduce_cast_bytes(blocks, 1, 2, 2, 2) == 2 * sum(L.values()) // 2
    kw = dict(data=2, zero=1, micro_batch=2, seq_len=8, n_microbatches=4, precision="bf16", blocks=blocks)
    alone = M.predict_rank_memory(cfg, **kw)
    # P = 1, A = 4: the fp32 accumulator 4·ΣL_u is reduce-scattered itself (= the casts here: one layer)
    assert alone.transient == M.zero_accumulator_bytes(blocks, 1, 2, 4, param_bytes=2) == cast
    piped = M.predict_rank_memory(cfg, pipeline=2, pipeline_rank=0, layer_ids=[0], **kw)
    held_once = M.activation_bytes(cfg, 2, 8, layers=1, has_head=False, precision="bf16", param_bytes=2).held_once
    freed = piped.activations - held_once
    assert piped.transient == max(0, cast - freed)
    small = M.predict_rank_memory(cfg, pipeline=2, pipeline_rank=0, layer_ids=[0], **{**kw, "seq_len": 1,
                                                                                       "micro_batch": 1})
    assert 0 < small.transient < cast                      # a cast larger than the freed activations shows


def test_pipeline_stage_buffers_by_hand():
    """Stages receive just in time and keep each in-flight micro-batch's output (theory.pipeline "Stage
    buffers"): with A = 8, B the boundary block, stage 0 of 2 (1F1B, 2 in flight) holds its 2 kept
    outputs and 1 output gradient, 3·B, whatever A; the last stage, 0 (its input buffers are the
    activations' inputs)."""
    from gridshard.theory.pipeline import boundary_bytes, stage_buffer_bytes

    cfg = tiny_config()
    B = boundary_bytes("none", False, 1, 2, 8, cfg.hidden)
    assert B == 2 * 8 * cfg.hidden * 4
    assert stage_buffer_bytes(False, 2, B) == 3 * B and stage_buffer_bytes(True, 1, B) == 0
    for rank, (ids, first, last) in enumerate(PIPELINE_RANKS):
        blocks = rank_parameter_blocks(cfg, layer_ids=list(ids), has_embedding=first, has_head=last)
        for A in (2, 8, 64):
            pred = M.predict_rank_memory(cfg, micro_batch=2, seq_len=8, n_microbatches=A, pipeline=2,
                                         pipeline_rank=rank, layer_ids=ids, blocks=blocks)
            assert pred.comm_buffers == M.model_state_bytes(blocks).comm_buffers + (3 * B if first else 0)
            assert pred.details["stage_buffers"] == (3 * B if first else 0)


# ---- context parallelism: the activation term at C > 1 (issue 25) -----------------------------
CONTEXT_SEQ = 16                                      # 2C = 4 chunks of 4 tokens


def _measure_context(mode, kv_heads=2):
    """On each of 2 context ranks: saved-for-backward bytes of one forward per (precision, recompute)."""
    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models import ModelConfig, Transformer
    from gridshard.parallel.recompute import apply_recompute

    cfg = ModelConfig(vocab_size=97, hidden=64, layers=1, heads=4, kv_heads=kv_heads, ffn_hidden=96,
                      max_seq_len=CONTEXT_SEQ)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, CONTEXT_SEQ), generator=g) for _ in range(2))
    out = {}
    for precision, recompute in [(p, r) for p in PRECISIONS for r in ("none", "selective", "full")]:
        with torch.device("meta"):
            plain = Transformer(cfg)
        model = parallelize(plain, build_mesh(1, 1, 1, "none", context=2), seed=0, device="cpu", context_mode=mode)
        apply_recompute(model, recompute)
        ctx = model.parallel_context
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
            loss = ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
        loss.backward()                              # every context rank takes part in the backward
        out[precision, recompute] = meter.bytes
    return out, cfg


@pytest.mark.parametrize("mode,kv_heads", [("ring", 2), ("all_to_all", 2), ("all_to_all", 1)])
def test_context_saved_activation_bytes_equal_the_formula(mode, kv_heads):
    """One decoder layer (GQA: 4 query heads over 2 k/v heads, or 1 replicated to the C ranks) on
    C = 2 context ranks, ring and all-to-all: the bytes autograd saves equal :func:`activation_bytes`
    with ``context=2`` exactly, for recompute none / selective / full, fp32 and bf16 autocast (the
    C > 1 term included)."""
    for rank, (got, cfg) in enumerate(run_on_ranks(2, _measure_context, mode, kv_heads)):
        for (precision, recompute), measured_bytes in got.items():
            formula = M.activation_bytes(cfg, 2, CONTEXT_SEQ, recompute=recompute, precision=precision,
                                         context=2, context_mode=mode).total
            assert measured_bytes == formula, (mode, rank, precision, recompute, measured_bytes, formula)


def test_context_term_by_hand():
    """The C > 1 layer: the rank's S/C tokens, plus the o_proj input copy n·H·d·e under recompute none."""
    from gridshard.theory.context import context_attention_saved_bytes

    cfg = tiny_config()
    one = M.layer_saved_bytes(cfg, "none", 1, False, 2 * 8, "none", 4)
    assert M.layer_saved_bytes(cfg, "none", 1, False, 2 * 8, "none", 4, context=4) == one + 2 * 8 * 4 * 16 * 4
    assert context_attention_saved_bytes(4, 16, 4, 16, 2, "selective") == 0
    a1, a4 = M.activation_bytes(cfg, 2, 32), M.activation_bytes(cfg, 2, 32, context=4)
    assert a4.rope_tables * 4 == a1.rope_tables and a4.per_layer == one + 2 * 8 * 4 * 16 * 4


def test_live_bytes_meter_counts_new_storages_until_freed():
    """:class:`gridshard.testing.live_bytes.LiveBytesMeter` (the peak the context benchmark reports):
    a new storage counts from its operator until freed; views, in-place results and tensors made
    before the block do not count."""
    from gridshard.testing.live_bytes import LiveBytesMeter

    x, mib = torch.ones(256, 1024), 1 << 20
    with LiveBytesMeter() as m:
        a = x * 2
        b = a + 1
        assert m.live == 2 * mib
        del a
        v, t = b.view(-1), x.t()
        b.add_(1)
        assert m.live == mib
        del b, v, t
    assert (m.peak, m.live) == (2 * mib, 0)
