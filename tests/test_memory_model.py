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
  1D + SP and 2D.
"""
import pytest
import torch

from gridshard.parallel.rank_blocks import rank_parameter_blocks
from gridshard.testing import run_on_ranks
from gridshard.theory import memory as M


def tiny_config(tied=False, kv_heads=2):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=kv_heads, ffn_hidden=96,
                       max_seq_len=16, tie_embeddings=tied)


BATCH, SEQ = 4, 8
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
    step, and the saved-for-backward bytes of one forward per recompute mode."""
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
    for recompute in ("none", "selective", "full"):
        with torch.device("meta"):
            plain = Transformer(cfg)
        model = parallelize(plain, build_mesh(1, 1, T, mode), sequence_parallel=sp, seed=0, device="cpu")
        apply_recompute(model, recompute)
        ctx = model.parallel_context
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            loss = ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
        out["saved"][recompute] = meter.bytes
        if recompute == "none":
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

    def with_adapter(self, cfg):
        init(self, cfg)
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


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_saved_activation_bytes_equal_the_formula(name, recompute):
    T, mode, sp, tied, kv = LAYOUTS[name]
    formula = M.activation_bytes(tiny_config(tied, kv), BATCH, SEQ, mode, T, sp, recompute).total
    for rank, got in enumerate(measured(name)):
        assert got["saved"][recompute] == formula, \
            f"{name} rank {rank} recompute={recompute}: measured {got['saved'][recompute]} B, formula {formula} B"


def test_recompute_orders_the_activations():
    """full < selective < none, and full keeps one residual block per layer."""
    cfg = tiny_config()
    a = {r: M.activation_bytes(cfg, BATCH, SEQ, "1d", 2, True, r) for r in ("none", "selective", "full")}
    assert a["full"].total < a["selective"].total < a["none"].total
    assert a["full"].per_layer == BATCH * SEQ * cfg.hidden // 2 * 4


# --- ZeRO stages on a hand-computed example -------------------------------------------------
# blocks: a [5, 3] matrix of layer 0, a [4] vector of layer 0, a [7, 2] root table; D = 2.
# rows per rank c = ceil(n0 / 2): [5,3] → c=3, padded 9, rank 1 owns rows 3..5 → 6 elements;
# [4] → c=2, padded 2, rank 1 owns 2; [7,2] → c=4, padded 8, rank 1 owns rows 4..7 → 6.
BLOCKS = [((5, 3), 0), ((4,), 0), ((7, 2), None)]
N_ALL, S_RANK1, P_ALL = 15 + 4 + 14, 6 + 2 + 6, 9 + 2 + 8


@pytest.mark.parametrize("zero,params,grads,opt,buffers,transient", [
    (0, 4 * N_ALL, 4 * N_ALL, 8 * N_ALL + 12, 0, 0),
    (1, 4 * N_ALL, 4 * N_ALL, 8 * S_RANK1 + 12, 4 * P_ALL, 0),
    (2, 4 * N_ALL, 4 * P_ALL, 8 * S_RANK1 + 12, 0, 0),
    # root gathered (4·14) + layer 0 gathered (4·19) + its all-gather buffer (4·2·(9+2))
    (3, 4 * P_ALL, 4 * P_ALL, 8 * S_RANK1 + 12, 0, 4 * 14 + 4 * 19 + 4 * 2 * 11),
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
    kw = dict(micro_batch=2, seq_len=8, n_microbatches=8, pipeline=2)
    first = M.predict_rank_memory(cfg, pipeline_rank=0, **kw)
    one = M.activation_bytes(cfg, 2, 8, layers=1, has_head=False)
    assert first.details["in_flight"] == 2 and first.activations == 2 * one.total
    gpipe = M.predict_rank_memory(cfg, pipeline_rank=0, schedule="gpipe", **kw)
    assert gpipe.activations == 8 * one.total
    assert first.params == 4 * sum(b.numel for b in rank_parameter_blocks(cfg, layer_ids=[0], has_head=False))


def test_prediction_adds_baseline_and_margin():
    cfg = tiny_config()
    pred = M.predict_rank_memory(cfg, micro_batch=2, seq_len=8, baseline_bytes=1000)
    state = M.model_state_bytes(rank_parameter_blocks(cfg), 0)
    acts = M.activation_bytes(cfg, 2, 8).total + M.logits_workspace_bytes(cfg, 2, 8)
    assert pred.total == 1000 + state.held + acts
    assert pred.total_with_margin == pred.total + int(0.1 * (state.held + acts))


def test_zero_backward_gradient_transient_by_hand():
    """Units: layer 0 = 5·3 + 4 = 19 elements, layer 1 = 6·2 = 12, root = 7·2 = 14; D = 2:
    padded buffers 2·(3·3 + 2) = 22, 2·(3·2) = 12, 2·(4·2) = 16 elements."""
    blocks = [((5, 3), 0), ((4,), 0), ((6, 2), 1), ((7, 2), None)]
    assert M.zero_gradient_transient(blocks, 1, 2) == 0                    # ZeRO-1 keeps full grads anyway
    assert M.zero_gradient_transient(blocks, 2, 2) == 4 * 19 + 4 * (22 + 16 + 12)       # one unit's grads
    assert M.zero_gradient_transient(blocks, 3, 2, micro_batches=2) == 4 * (19 + 12 + 14) + 4 * (22 + 16 + 12)
