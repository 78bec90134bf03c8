"""Context parallelism wired into training: a run with the sequence split over C context ranks is
the one-process run, step by step (fp32, masked targets, grouped-query attention).

Model: 8 query heads over 4 k/v heads (GQA; all_to_all at C = 4 needs C | 4 k/v heads), data:
Python's standard library as bytes with ``data.ignore_token: 32`` (the space byte: about one
target in six is masked, unevenly over the chunks, so a loss divisor that forgot the masked
targets or the other context ranks' tokens moves the loss by percents). Each layout is compared
with one process over 10 steps of AdamW with clipping active: loss and global gradient norm
within 1e-5 relative per step, final gathered parameters within 1e-5 (relative Frobenius).

In ``make test``: (D, P, C, T) = (1, 1, 4, 1) ring, and all_to_all at C = 4 over 2 k/v heads
(replicated). Wide: (1, 1, 4, 1) all_to_all, (1, 1, 2, 4) 2D,
(1, 2, 2, 1) 1F1B and GPipe, and with 4 layers and V = 2 interleaved 1F1B and zero bubble (ring; zero
bubble also all_to_all), (2, 1, 2, 1) ZeRO-2, (1, 1, 2, 1) ZeRO-3, (1, 1, 2, 2) 1D + sequence
parallelism (ring and all_to_all), C = 2 with selective (ring) and full (all_to_all) recompute: the
attention, collectives included, runs again in backward on every context rank in the same order.
"""
import pytest
import torch

from gridshard.testing import run_on_ranks
from gridshard.testing.compare import max_rel, max_rel_tensors
from gridshard.testing.train_cache import TrainCache

MODEL = {"preset": None, "vocab_size": 256, "hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4,
         "ffn_hidden": 128, "max_seq_len": 32}
BASE = {"model": MODEL,
        "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000, "ignore_token": 32},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 10, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3,
                  "grad_clip": 0.5, "log_interval": 1, "seed": 7, "precision": "fp32"}}
TOL = 1e-5


def _config(D=1, C=1, T=1, mode="ring", sp=False, zero=0, recompute="none", tensor_mode=None, P=1,
            schedule="1f1b", V=1):
    tensor_mode = tensor_mode or ("1d" if T > 1 else "none")
    parallel = {"data": D, "pipeline": P, "context": C, "context_mode": mode, "tensor": T,
                "tensor_mode": tensor_mode, "sequence_parallel": sp, "pipeline_schedule": schedule}
    return {**BASE, "train": {**BASE["train"], "zero": zero, "recompute": recompute},
            "parallel": {**parallel, "virtual_stages": V} if V != 1 else parallel}


def _train_body(cfg):
    from gridshard import gathered_state_dict
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    final = gathered_state_dict(trainer.model)
    h = trainer.history
    sends = {op: (e.count, e.payload_bytes) for (op, axis), e in trainer.ledger.entries.items()
             if axis == "context" and e.count}
    return losses, [r["grad_norm"] for r in h], [r["valid_tokens"] for r in h], final, sends


def _results_and_ledgers(per_rank):
    params = {k: v for r in per_rank for k, v in r[3].items()}     # pipeline: each rank its stage's
    return (*per_rank[0][:3], params), [r[4] for r in per_rank]


_RUNS = TrainCache(_train_body, agree=3, combine=_results_and_ledgers, timeout=300)


def run_config(cfg):
    """(losses, grad norms, valid-target counts, final parameters) of ``cfg``'s run, run once per
    config (tests/test_context_hf.py shares it); every rank must report the same history."""
    return _RUNS(cfg)[0]


def context_ledgers(cfg) -> list:
    """Per rank, {op: (calls, payload bytes)} of the context axis over ``cfg``'s whole run
    (:func:`run_config` first)."""
    return _RUNS(cfg)[1]


def _run(**layout):
    return run_config(_config(**layout))


LAYOUTS = {  # name: _config's arguments
    "C4-ring": dict(C=4),
    "C4-all_to_all": dict(C=4, mode="all_to_all"),
    "C2-T4-2d": dict(C=2, T=4, tensor_mode="2d"),
    "P2-C2-1f1b": dict(P=2, C=2),
    "P2-C2-gpipe": dict(P=2, C=2, schedule="gpipe"),
    "D2-C2-zero2": dict(D=2, C=2, zero=2),
    "C2-zero3": dict(C=2, zero=3),
    "C2-T2-1d-SP": dict(C=2, T=2, sp=True),
    "C2-T2-1d-SP-all_to_all": dict(C=2, T=2, sp=True, mode="all_to_all"),
    "C2-selective": dict(C=2, recompute="selective"),
    "C2-full-all_to_all": dict(C=2, mode="all_to_all", recompute="full"),
}
WIDE = set(LAYOUTS) - {"C4-ring"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.wide) if n in WIDE else n for n in LAYOUTS])
def test_context_layout_gives_the_one_process_run(name):
    ref_loss, ref_norm, ref_valid, ref_params = _run()
    assert min(ref_valid) < BASE["train"]["global_batch"] * BASE["data"]["seq_len"], "no target is masked"
    assert max(ref_norm) > BASE["train"]["grad_clip"], "clipping must be active"
    loss, norm, valid, params = _run(**LAYOUTS[name])
    assert valid == ref_valid
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), max_rel_tensors(params, ref_params)
    print(f"{name}: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert sorted(params) == sorted(ref_params)
    assert dl <= TOL, f"{name}: loss differs by {dl:.2e}"
    assert dn <= TOL, f"{name}: grad norm differs by {dn:.2e}"
    assert dp <= TOL, f"{name}: final parameters differ by {dp:.2e}"


# Interleaved 1F1B and zero bubble need S = P·V = 4 stages, so 4 layers. At lr 3e-3 that model
# amplifies the C = 2 attention's fp32 rounding (4e-7 in the step-1 gradients) to 4.3e-4 in the
# gradient norm at step 7 with no pipeline at all: (1, 1, 2, 1) gives the losses of (1, 2, 2, 1)
# interleaved and zero bubble bit for bit (gradient norms within 1.4e-16). At lr 1e-3 the final
# parameters still drift 2.7e-5 (again at P = 1), likely through AdamW's step g/(√v + ε): with
# ε = 1e-8 an element whose gradient is near 0 moves by a whole lr in the direction of its
# rounding. With ε = 1e-6 (clipping still active) every C = 2 run stays within 1e-5 of one process
# (P = 1: gradient norm 2.6e-7, final parameters 5.9e-7).
DEEP = {"model": {**MODEL, "layers": 4}, "train": {"lr": 1e-3, "min_lr": 1e-4, "adam_eps": 1e-6}}
SCHEDULES = {  # name: _config's arguments; two virtual stages of one layer on each pipeline rank
    "P2-C2-interleaved": dict(P=2, C=2, V=2, schedule="interleaved_1f1b"),
    "P2-C2-zero_bubble": dict(P=2, C=2, V=2, schedule="zero_bubble"),
    "P2-C2-zero_bubble-all_to_all": dict(P=2, C=2, V=2, schedule="zero_bubble", mode="all_to_all"),
}


def _deep(**layout):
    cfg = _config(**layout)
    return {**cfg, "model": DEEP["model"], "train": {**cfg["train"], **DEEP["train"]}}


def _expected_context_ledger(mode: str) -> dict:
    """{op: (calls, bytes)} per rank over the run: per layer and micro-batch the forward's and the
    backward's ring sends or all-to-alls (:mod:`gridshard.theory.context`), once each, times the
    rank's 2 layers, its A = G/m = 2 micro-batches and 10 steps."""
    from gridshard.theory.context import all_to_all_attention_volume, ring_attention_sends

    t, m = BASE["train"], MODEL
    theory = (ring_attention_sends if mode == "ring" else all_to_all_attention_volume)(
        2, t["micro_batch"], BASE["data"]["seq_len"] // 2, m["heads"], m["kv_heads"], m["hidden"] // m["heads"], 4)
    per = [f + b for f, b in zip(theory["forward"], theory["backward"])]
    times = 2 * (t["global_batch"] // t["micro_batch"]) * t["steps"]
    return {"send" if mode == "ring" else "all_to_all": (per[0] * times, per[1] * times)}


def test_all_to_all_replicates_fewer_kv_heads_than_context_ranks():
    """2 k/v heads on C = 4 context ranks, all_to_all (issue 39): each k/v head goes to 2 ranks, and
    10 steps equal one process within 1e-5 (loss, gradient norm, final parameters); the context
    ledger is the closed form with the 4 traded k/v heads."""
    from gridshard.theory.context import all_to_all_attention_volume

    few = {**BASE["model"], "kv_heads": 2}
    cfg = {**_config(C=4, mode="all_to_all"), "model": few}
    ref_loss, ref_norm, _, ref_params = run_config({**_config(), "model": few})
    loss, norm, _, params = run_config(cfg)
    assert max(max_rel(loss, ref_loss), max_rel(norm, ref_norm), max_rel_tensors(params, ref_params)) <= TOL
    b, s_r, d = BASE["train"]["micro_batch"], BASE["data"]["seq_len"] // 4, MODEL["hidden"] // MODEL["heads"]
    one = all_to_all_attention_volume(4, b, s_r, MODEL["heads"], 2, d, 4)
    passes = MODEL["layers"] * BASE["train"]["steps"] * BASE["train"]["global_batch"] // b
    assert context_ledgers(cfg)[0]["all_to_all"] == (8 * passes, passes * (one["forward"][1] + one["backward"][1]))


@pytest.mark.wide
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_interleaved_and_zero_bubble_at_c2_give_the_one_process_run(name):
    """(D, P, C, T) = (1, 2, 2, 1), 4 layers, V = 2: interleaved 1F1B and zero bubble (whose backward
    is an input pass and a deferred weight pass) equal one process within 1e-5 per step (loss,
    gradient norm) and in the final parameters. Every rank's context traffic is that of one forward
    and one backward of the attention per layer and micro-batch: zero bubble's weight pass starts
    at the projections' matmuls and does not run the attention's backward (sends included) again."""
    ref_loss, ref_norm, ref_valid, ref_params = run_config(_deep())
    assert max(ref_norm) > BASE["train"]["grad_clip"], "clipping must be active"
    cfg = _deep(**SCHEDULES[name])
    loss, norm, valid, params = run_config(cfg)
    assert valid == ref_valid and sorted(params) == sorted(ref_params)
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), max_rel_tensors(params, ref_params)
    print(f"{name}: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert max(dl, dn, dp) <= TOL, (name, dl, dn, dp)
    want = _expected_context_ledger(SCHEDULES[name].get("mode", "ring"))
    assert all(sends == want for sends in context_ledgers(cfg)), (context_ledgers(cfg), want)


def test_rope_tables_at_global_positions():
    """A context rank's RoPE rows are the whole sequence's rows at its chunks' global positions."""
    from gridshard.context import shard_sequence
    from gridshard.models.rope import RopeTableCache

    cache = RopeTableCache()
    cos, sin = cache.get(32, 8, 10000.0, "cpu")
    for rank in range(4):
        c, s = cache.get(8, 8, 10000.0, "cpu", context=(4, rank))
        assert torch.equal(c, shard_sequence(cos, 4, rank, dim=0))
        assert torch.equal(s, shard_sequence(sin, 4, rank, dim=0))


def _error(cfg, world):
    from gridshard.config import resolve_config
    from gridshard.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        resolve_config(cfg, world_size=world, cuda_available=False)
    return str(info.value)


def test_context_config_is_validated_before_launch():
    """One-line errors, with the rule and valid values, before any process group exists."""
    from gridshard.config import resolve_config
    from gridshard.job_layout import ContextMode, JobLayout

    cfg = resolve_config(_config(D=2, C=2, T=2, mode="all_to_all"), world_size=8, cuda_available=False)
    layout = JobLayout.from_config(cfg)
    assert (layout.context, layout.context_mode, layout.world) == (2, ContextMode.ALL_TO_ALL, 8)
    assert resolve_config(_config(), world_size=1).parallel.context == 1
    assert JobLayout.from_config(resolve_config(_config(), world_size=1)).context_mode is ContextMode.RING
    msg = _error(_config(C=2), 4)
    assert "data×pipeline×context×tensor = 1×1×2×1 = 2" in msg and "world size is 4" in msg, msg
    bad_len = {**_config(C=3), "data": {**BASE["data"], "seq_len": 32}}
    msg = _error(bad_len, 3)
    assert "seq_len=32" in msg and "multiple of 6" in msg and "30 or 36" in msg, msg
    sp_len = {**_config(C=2, T=4, sp=True), "data": {**BASE["data"], "seq_len": 20},
              "model": {**MODEL, "max_seq_len": 32}}
    msg = _error(sp_len, 8)
    assert "C·T = 8" in msg and "multiple of 8" in msg, msg
    msg = _error(_config(C=8, T=2, mode="all_to_all"), 16)  # T=2 leaves 4 query heads per rank: 8 ∤ 4
    assert "all_to_all" in msg and "4 query heads" in msg and "ring" in msg, msg
    twelve = {**_config(C=6, mode="all_to_all"), "model": {**MODEL, "hidden": 96, "heads": 12, "max_seq_len": 36},
              "data": {**BASE["data"], "seq_len": 36}}
    msg = _error(twelve, 6)                                  # 4 k/v heads on C = 6: 6 ∤ 4 and 4 ∤ 6
    assert "4 k/v heads" in msg and "neither split over C nor divide it" in msg, msg
    for kw in SCHEDULES.values():                 # every pipeline schedule is built at C > 1
        assert resolve_config(_deep(**kw), world_size=4, cuda_available=False).parallel.virtual_stages == 2
    compiled = {**_config(C=2), "train": {**_config(C=2)["train"], "compile": True}}
    assert resolve_config(compiled, world_size=2, cuda_available=False).train.compile    # built: tests/test_compile.py
    grid = resolve_config(_config(C=2, T=4, mode="all_to_all", tensor_mode="2d"), world_size=8)
    assert JobLayout.from_config(grid).q == 2                     # 2D: 4/q = 4 heads, 2 k/v heads per rank
    assert resolve_config(_config(C=4, T=4, mode="all_to_all", tensor_mode="2d"), world_size=16)   # 2 k/v heads: ×2
    msg = _error(_config(C=8, T=4, mode="all_to_all", tensor_mode="2d"), 32)
    assert "4 query heads" in msg, msg


def _mesh_body(D, C, T):
    from gridshard.mesh import build_mesh

    mesh = build_mesh(D, 1, T, "1d" if T > 1 else "none", context=C)
    return mesh.context.ranks, mesh.tensor.ranks, mesh.data.ranks, mesh.data_context.ranks, mesh.world_size


def test_mesh_context_axis_sits_between_pipeline_and_tensor():
    """rank = ((d·P + p)·C + c)·T + t: a context group is C ranks T apart; gradients are reduced
    over data × context (``data_context``); at C = 1 ``data_context`` is ``data``."""
    got = run_on_ranks(4, _mesh_body, 1, 2, 2)
    assert [g[0] for g in got] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [g[1] for g in got] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [g[3] for g in got] == [(0, 2), (1, 3), (0, 2), (1, 3)] and got[0][4] == 4
    got = run_on_ranks(4, _mesh_body, 2, 2, 1)
    assert [g[0] for g in got] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [g[2] for g in got] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(g[3] == (0, 1, 2, 3) for g in got)
    got = run_on_ranks(4, _mesh_body, 4, 1, 1)
    assert all(g[0] == (r,) and g[3] == g[2] == (0, 1, 2, 3) for r, g in enumerate(got))


def _ckpt_body(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    sq = {n: trainer.optimizer.state[p]["exp_avg_sq"].clone() for n, p in trainer.model.named_parameters()
          if trainer.optimizer.state.get(p)}
    return trainer.run(), sq if trainer.rank == 0 else None


@pytest.mark.wide
def test_checkpoint_saved_at_c4_resumes_at_c1_and_at_c2_t2(tmp_path):
    """Parameters are replicated over context ranks (ZeRO-2 shards them over data × context): the
    checkpoint holds every canonical tensor once, and a run saved at C = 4 (ZeRO-2) continues at
    C = 1 and at (C = 2, T = 2, 1D + SP) within 1e-5 of its uninterrupted run."""
    import os

    from gridshard.checkpoint.files import checkpoints_root
    from gridshard.checkpoint.reader import read_checkpoint

    def cfg(C, T=1, sp=False, zero=0, **train):
        c = _config(C=C, T=T, sp=sp, zero=zero)
        return {**c, "train": {**c["train"], "steps": 6, "save_interval": 3, **train}}

    full, _ = run_on_ranks(4, _ckpt_body, cfg(4, zero=2), str(tmp_path / "c4"), timeout=300)[0]
    step3 = os.path.join(checkpoints_root(str(tmp_path / "c4")), "step_3")
    _, model = read_checkpoint(step3, "model.")
    assert model["layers.0.self_attn.k_proj.weight"].shape == (32, 64)       # 4 k/v heads × 8, whole
    for C, T, sp in ((1, 1, False), (2, 2, True)):
        losses, sq = run_on_ranks(C * T, _ckpt_body, cfg(C, T, sp, resume=step3), str(tmp_path / f"c{C}"),
                                  timeout=300)[0]
        rel = max_rel(losses, full[3:])
        assert len(losses) == 3 and rel <= TOL, (C, T, rel)
        assert all(float(v.norm()) > 0 for v in sq.values())                        # moments loaded, not reset


def test_parallelize_wires_attention_and_positions_and_refuses_other_models():
    """On a context axis, every attention module attends over it (ring or all-to-all, the mode
    asked for) and RoPE reads the rank's global positions; a ViT, or all-to-all heads that C does
    not divide, is a LayoutError before anything is materialised (laid out on meta, no group)."""
    from gridshard.context import all_to_all_attention, ring_attention
    from gridshard.errors import LayoutError
    from gridshard.mesh import ShapeMesh
    from gridshard.models import ModelConfig, Transformer
    from gridshard.models.vit import VisionTransformer, ViTConfig
    from gridshard.parallel import parallelize

    def laid_out(mode, kv_heads=4, C=2, rank=1):
        with torch.device("meta"):
            plain = Transformer(ModelConfig(hidden=64, heads=8, kv_heads=kv_heads))
        return parallelize(plain, ShapeMesh(context=C, context_rank=rank), device="meta", context_mode=mode)

    for mode, fn in (("ring", ring_attention), ("all_to_all", all_to_all_attention)):
        model = laid_out(mode)
        assert model.context_split == (2, 1)
        attend = [layer.self_attn.context_attention for layer in model.layers]
        assert all(a.func is fn and a.keywords["axis"].size == 2 and a.keywords["axis"].rank == 1 for a in attend)
    laid_out("all_to_all", kv_heads=2, C=4, rank=0)           # 2 k/v heads, each replicated on 2 of 4 ranks
    with pytest.raises(LayoutError, match="8 query heads"):
        laid_out("all_to_all", kv_heads=2, C=16, rank=0)
    with torch.device("meta"):
        vit = VisionTransformer(ViTConfig())
    with pytest.raises(LayoutError, match="VisionTransformer"):
        parallelize(vit, ShapeMesh(context=2), device="meta")
    with torch.device("meta"):
        plain = Transformer(ModelConfig())
    assert parallelize(plain, ShapeMesh(), device="meta").layers[0].self_attn.context_attention is None
