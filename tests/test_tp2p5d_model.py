"""2.5D tensor parallelism in training: ``parallel.tensor_mode: 2.5d`` with ``tensor_depth`` d is the
one-process run, step by step, and its checkpoints resume at 2D and 1D.

Depth layer k of a 2.5D group is a complete 2D grid on batch slice k with the same weights, so
the job lays the model out as 2D on its layer's q² ranks and reduces the gradients over data ×
context × depth (the mesh's ``data_context``; docs/tp2p5d.md "In training"). Model: grouped-query
attention (4 heads over 2 kv heads), an odd vocabulary (259: padded in 2D), data: Python's standard
library as bytes with ``data.ignore_token: 32`` (about one target in six masked, unevenly over the
d·q = 4 batch blocks), 6 steps of AdamW with clipping active. Compared with one process: loss
and global gradient norm within 1e-5 relative per step, the final gathered parameters within
1e-5 (relative Frobenius).

make test: the config rules and the layout facts (no ranks; 8-rank runs take minutes on the
shared 2 cores). Wide (``-m wide``): (D, P, T) = (1, 1, 8) q = 2, d = 2 at ZeRO-0 and at ZeRO-3
with selective recompute (ZeRO then shards over the depth replicas: each rank steps half of its
layer's block), 16 ranks: (2, 1, 8) at ZeRO-2 and context C = 2 (ring) × (1, 1, 8); the (1, 1, 8)
ZeRO-0 run's
step-3 checkpoint resumed at 2D (T = 4) and 1D (T = 2), and the one-process run's at 2.5D: steps
4-6 as the uninterrupted run; a Hugging Face Llama (GQA, vocabulary 259, tied) at (1, 1, 8) 2.5D;
pipeline stages, (1, 2, 8) on 16 ranks, tied embeddings, validation through the stages: 1F1B,
interleaved 1F1B, GPipe at ZeRO-3 and zero bubble at ZeRO-2 (docs/tp2p5d.md "Pipeline").
"""
import json
import os

import pytest
import torch.distributed as dist

from gridshard.testing.compare import max_rel

from .tp_model_runs import (BASE, HF, SAVE_AT, STEPS, TOL, check_pipeline_run, config, config_error, model_runs,
                            param_rel, reference_fixtures)


def _facts(trainer) -> dict:
    """What this rank's mesh and reducer say about the 2.5D layout, and the step ledger's depth traffic."""
    m, ledger = trainer.mesh, trainer.ledger
    stepped = sum(t.numel() for _, t in trainer.reducer.optimizer_tensors())
    return {"rank": dist.get_rank(), "depth": (m.depth.size, m.depth.rank), "tensor": m.tensor.size,
            "grid": (getattr(m, "grid_row", None), getattr(m, "grid_col", None)),
            "batch": (m.batch_blocks, m.batch_index),
            "replicas": (m.data_context.size, m.data_context.ranks), "mode": (str(m.job_mode), str(m.tensor_mode)),
            "depth_calls": ledger.count(axis="depth"), "replica_calls": ledger.count(axis="data_context"),
            "replica_bytes": ledger.payload_bytes(op="all_reduce", axis="data_context"),
            "local_numel": sum(p.numel() for p in trainer.params), "stepped_numel": stepped}


# (losses, grad norms, valid counts, final parameters, every rank's facts) of a config, run once
_run = model_runs(_facts, timeout=600)
reference_run, reference = reference_fixtures(_run, config())


@pytest.fixture(scope="module")
def run_2p5d(tmp_path_factory):
    """The 2.5D (q = 2, d = 2) ZeRO-0 run, checkpointing at steps 3 and 6, and its run directory."""
    run_dir = tmp_path_factory.mktemp("tp2p5d") / "run"
    return run_dir, _run(config(8, "2.5d", 2), str(run_dir))


def _check_layout_facts(facts, D=1):
    """Rank = 8·(data [× context] index) + t, t = k·q² + i·q + j; the reducer spans the D·(C·)d ranks
    at my grid position (data, context outer, depth inner); no per-layer depth hook."""
    for f in facts:
        k, rest = divmod(f["rank"] % 8, 4)
        assert f["depth"] == (2, k) and f["grid"] == divmod(rest, 2) and f["tensor"] == 4
        assert f["batch"] == (4, 2 * k + rest // 2)
        group = tuple(8 * a + 4 * b + rest for a in range(D) for b in range(2))
        assert f["replicas"] == (2 * D, group) and f["mode"] == ("2.5d", "2d")
        assert f["depth_calls"] == 0 and f["replica_calls"] > 0


@pytest.mark.wide
@pytest.mark.parametrize("zero,D,C", [(0, 1, 1), (3, 1, 1), (2, 2, 1), (0, 1, 2)],
                         ids=["zero0", "zero3", "D2-zero2", "C2-ring"])
def test_2p5d_training_gives_the_one_process_run(reference, run_2p5d, zero, D, C):
    """(D, C, T) = (1, 1, 8) at ZeRO-0 and at ZeRO-3 with selective recompute; 16 ranks: (2, 1, 8) at
    ZeRO-2 and (1, 2, 8), context parallelism (ring) over 2.5D."""
    ref_loss, ref_norm, ref_valid, ref_params, _ = reference
    loss, norm, valid, params, facts = run_2p5d[1] if (zero, D, C) == (0, 1, 1) else \
        _run(config(8, "2.5d", 2, zero=zero, D=D, C=C, recompute="selective" if zero == 3 else "none"))
    assert valid == ref_valid
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), param_rel(params, ref_params)
    what = f"2.5D D={D} C={C} q=2 d=2 ZeRO-{zero}{' selective recompute' if zero == 3 else ''}"
    print(f"{what}: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert dl <= TOL and dn <= TOL and dp <= TOL, (dl, dn, dp)
    _check_layout_facts(facts, D * C)
    steps = BASE["train"]["steps"]
    for f in facts:       # ZeRO-3 shards over data × depth: each rank steps half of its layer's block
        if zero == 0 and C == 1:     # the depth sum: one fp32 all-reduce of the rank's whole block per step
            assert f["stepped_numel"] == f["local_numel"] and f["replica_bytes"] == steps * 4 * f["local_numel"], f
        elif zero:
            n = f["local_numel"] / (2 * D)
            assert n <= f["stepped_numel"] <= n + 64, f


@pytest.mark.wide
@pytest.mark.parametrize("source,target", [("2.5d", (4, "2d", 1)), ("2.5d", (2, "1d", 1)), ("one", (8, "2.5d", 2))],
                         ids=["2.5d-to-2d-T4", "2.5d-to-1d-T2", "one-to-2.5d"])
def test_2p5d_checkpoint_resumes_at_2d_and_1d(run_2p5d, reference_run, source, target, tmp_path):
    """A 2.5D checkpoint is the 2D placement replicated over depth: resumed from step 3 at another
    layout, steps 4-6 and the final parameters are the uninterrupted run's; and a one-process
    checkpoint resumes at 2.5D the same way."""
    from gridshard.checkpoint.files import checkpoints_root

    run_dir, (full_loss, _, _, full_params, _) = run_2p5d if source == "2.5d" else reference_run
    step3 = os.path.join(checkpoints_root(str(run_dir)), f"step_{SAVE_AT}")
    T, mode, depth = target
    loss, _, _, params, _ = _run(config(T, mode, depth, resume=step3), str(tmp_path / "resumed"))
    assert len(loss) == STEPS - SAVE_AT
    dl, dp = max_rel(loss, full_loss[SAVE_AT:]), param_rel(params, full_params)
    print(f"{source} step 3 → {mode} T={T}: loss {dl:.1e}, final params {dp:.1e}")
    assert dl <= TOL and dp <= TOL, (dl, dp)


@pytest.mark.wide
def test_2p5d_hugging_face_llama_gives_the_one_process_run(tmp_path):
    """A Hugging Face ``LlamaForCausalLM`` (GQA, odd vocabulary, tied embeddings) at 2.5D through the
    same HF plan table: 6 steps as one process."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, "tie_word_embeddings": True}))

    def cfg(*layout):
        return {**config(*layout), "model": {"hf_config": str(path)}}

    ref_loss, ref_norm, ref_valid, ref_params, _ = _run(cfg())
    loss, norm, valid, params, facts = _run(cfg(8, "2.5d", 2))
    assert valid == ref_valid and min(ref_valid) < 8 * 16
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), param_rel(params, ref_params)
    print(f"HF 2.5D q=2 d=2 tied: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert dl <= TOL and dn <= TOL and dp <= TOL, (dl, dn, dp)
    _check_layout_facts(facts)


@pytest.mark.wide
@pytest.mark.parametrize("schedule,V,layers,zero", [("1f1b", 1, 2, 0), ("interleaved_1f1b", 2, 4, 0),
                                                    ("gpipe", 1, 2, 3), ("zero_bubble", 2, 4, 2)],
                         ids=["1f1b", "interleaved", "gpipe-zero3", "zero_bubble-zero2"])
def test_2p5d_pipeline_stages_give_the_one_process_run(schedule, V, layers, zero):
    """(D, P, T) = (1, 2, 8), q = 2, d = 2 (16 ranks), tied embeddings, masked targets: every
    depth layer's grid position (k, i, j) sends its [m/(d·q), s, h/q] block to (k, i, j) of the
    next stage (the ledger's sends = the formula), the tied table's two copies summed over the
    pair at the same (k, i, j), the depth summed by the reducer; losses, gradient norms,
    validation losses and final parameters within 1e-5 of one process; ZeRO-3 (GPipe) and ZeRO-2
    (zero bubble) shard over the d depth replicas of a stage's block."""
    got = check_pipeline_run("2.5d", 2, schedule, V, layers, zero, f"2.5D P=2 {schedule} ZeRO-{zero} tied",
                             facts=_facts)
    for r, out in enumerate(got):
        f = out[5]
        p, t = divmod(r, 8)
        k, rest = divmod(t, 4)
        assert f["pipe"] == (t, 8 + t) and f["batch"] == (4, 2 * k + rest // 2), f     # same (k, i, j) per stage
        assert f["replicas"] == (2, (8 * p + rest, 8 * p + 4 + rest)) and f["depth_calls"] == 0, f


def test_2p5d_config_rules_and_layout_facts():
    """One-line errors naming the valid values before any process group; the job layout's facts
    (2D on a layer's q² ranks, m/d rows per layer), and the memory check's pricing as that 2D layout."""
    from gridshard.config import resolve_config
    from gridshard.errors import LayoutError
    from gridshard.job_layout import JobLayout, TensorMode
    from gridshard.planner.fit import config_layout
    from gridshard.theory.pipeline import boundary_bytes

    cfg = resolve_config(config(8, "2.5d", 2), world_size=8, cuda_available=False)
    layout = JobLayout.from_config(cfg)
    assert (layout.depth, str(layout.layer_mode), layout.layer_tensor, layout.q) == (2, "2d", 4, 2)
    priced = config_layout(cfg)
    assert (priced.data, priced.tensor, priced.tensor_mode, priced.micro_batch) == (2, 4, "2d", 2)
    with pytest.raises(LayoutError, match="call mode.layer_layout"):
        TensorMode("2.5d").side(8)
    assert "use tensor in (12, 27, 48, 75, ...) for d=3" in config_error(config(8, "2.5d", 3), 8)
    assert "tensor=8 is not a perfect square" in config_error(config(8, "2d"), 8)
    assert "tensor_depth=2 with tensor_mode='2d': only 2.5D has depth layers" in config_error(config(4, "2d", 2), 4)
    assert "tensor=4 with tensor_mode='2.5d' and tensor_depth=4" in config_error(config(4, "2.5d", 4), 4)
    assert "splits each micro-batch into d·q = 4 row blocks. Fix: use a multiple of 4" in \
        config_error(config(8, "2.5d", 2, micro_batch=2), 8)
    base = config(8, "2.5d", 2)
    piped = resolve_config({**base, "parallel": {**base["parallel"], "pipeline": 2}}, world_size=16,
                           cuda_available=False)            # pipeline stages at 2.5D: accepted
    assert JobLayout.from_config(piped).split.counts == (1, 1)
    # the stage boundary: depth layer k's 2D block of its m/d rows, [m/(d·q), s, h/q], 1 KiB in fp32
    assert TensorMode("2.5d").boundary_block(8, False, 4, 16, 32, depth=2) == (1, 16, 16)
    assert TensorMode("2.5d").boundary_block(4, False, 4, 16, 32, depth=1) == \
        TensorMode("2d").boundary_block(4, False, 4, 16, 32) == (2, 16, 16)
    assert boundary_bytes("2.5d", False, 8, 4, 16, 32, depth=2) == 1 * 16 * 16 * 4
    assert boundary_bytes("2.5d", False, 18, 6, 16, 30, dtype="bf16", depth=2) == 1 * 16 * 10 * 2     # q = 3
    assert "parallel.sequence_parallel=True is invalid" in \
        config_error({**base, "parallel": {**base["parallel"], "sequence_parallel": True}}, 8)
