"""3D tensor parallelism in training: ``parallel.tensor_mode: 3d`` (T = q³) is the one-process run,
step by step, and its checkpoints resume at 2.5D, 2D and 1D (and a one-process checkpoint at 3D).

The job mesh lays the tensor dim out as a q×q×q cube (data, pipeline, weight, input, output); the
model is laid out by ``parallelize`` on ``mesh.cube`` (docs/tp3d.md "In training"): column
projections on the residual orientation, row projections on the swapped one, norms, embedding and
head on the residual one; the logits come out in the swapped orientation, so a rank's targets are
batch block i·q + l (``ParallelContext.shard_targets``) while its tokens are block i·q + j. Model:
grouped-query attention (4 heads over 2 kv heads), an odd vocabulary (259: padded to 260 in 3D),
data: Python's standard library as bytes with ``data.ignore_token: 32`` (about one target in six
masked, unevenly over the q² = 4 batch blocks), 6 steps of AdamW with clipping active. Compared
with one process: loss and global gradient norm within 1e-5 relative per step, the final gathered
parameters within 1e-5 (relative Frobenius).

make test: the config rules and layout facts (no ranks), and ONE 8-rank test: (D, P, T) = (1, 1, 8)
q = 2 at ZeRO-0 against one process, and its step-3 checkpoint resumed at 2.5D (q = 2, d = 2) in
the same 8-rank worker pool; ``gridshard export`` and ``gridshard generate`` from that run's directory
in one process (no new ranks). Wide (``-m wide``): ZeRO-3 with selective recompute;
the step-3 checkpoint resumed at 2D (T = 4) and 1D + sequence parallelism (T = 2), and the one-process
run's at 3D; Hugging Face ``LlamaForCausalLM`` (GQA, vocabulary 259) tied and untied; 16 ranks: pipeline
(1, 2, 8) under 1F1B, GPipe, interleaved 1F1B and zero bubble with tied embeddings and validation, data
(2, 1, 8) at ZeRO-3, context (1, C = 2, 8) with ring attention for our Llama and the Hugging Face one.
``train.compile`` at 3D: tests/test_compile.py (compiled against eager, nothing recompiled after step 1).
"""
import json
import os
import time

import pytest
import torch.distributed as dist

from gridshard.testing.compare import max_rel

from .tp_model_runs import (HF, MODEL, SAVE_AT, STEPS, TOL, check_pipeline_run, config, config_error, model_runs,
                            param_rel, reference_fixtures)


def _config(T=1, mode="none", depth=1, zero=0, D=1, sp=False, C=1, **train):
    return config(T, mode, depth, zero, D, C, sp=sp, **train)


def _facts(trainer) -> dict:
    """What this rank's mesh says about the 3D layout, and what the reducer steps."""
    m = trainer.mesh
    cube = m.cube
    stepped = sum(t.numel() for _, t in trainer.reducer.optimizer_tensors())
    return {"rank": dist.get_rank(), "tensor": (m.tensor.size, m.tensor.rank),
            "cube": cube.coords() if cube is not None else None,
            "batch": (m.batch_blocks, m.batch_index, m.logits_batch_index),
            "replicas": (m.data_context.size, m.data_context.ranks), "mode": str(m.tensor_mode),
            "local_numel": sum(p.numel() for p in trainer.params), "stepped_numel": stepped}


def _run_facts(trainer) -> dict:
    """:func:`_facts` and the run's collective counts per (op, axis), the world axis left out."""
    calls = {k: v.count for k, v in trainer.ledger.entries.items() if k[1] != "world"}
    return {**_facts(trainer), "calls": calls}


# (losses, grad norms, valid counts, final parameters, every rank's facts) of a config, run once
_run = model_runs(_run_facts, timeout=900)
reference_run, reference = reference_fixtures(_run, _config())


@pytest.fixture(scope="module")
def run_3d(tmp_path_factory):
    """The 3D (q = 2) ZeRO-0 run, checkpointing at steps 3 and 6, and its run directory."""
    run_dir = tmp_path_factory.mktemp("tp3d") / "run"
    start = time.perf_counter()
    out = _run(_config(8, "3d"), str(run_dir))
    print(f"3D (1, 1, 8) 6 steps: {time.perf_counter() - start:.1f} s wall")
    return run_dir, out


def _check_layout_facts(facts, D=1):
    """Rank = 8·data index + t, t = (i·q + j)·q + l; tokens block i·q + j, targets block i·q + l;
    the reducer spans the D ranks at my cube position (no tensor-axis replicas)."""
    for f in facts:
        t = f["rank"] % 8
        i, j, l = t // 4, (t // 2) % 2, t % 2
        assert f["tensor"] == (8, t) and f["cube"] == {"weight": i, "input": j, "output": l}, f
        assert f["batch"] == (4, 2 * i + j, 2 * i + l) and f["mode"] == "3d", f
        assert f["replicas"] == (D, tuple(8 * a + t for a in range(D))), f


def _check_against(ref, got, what):
    ref_loss, ref_norm, ref_valid, ref_params, _ = ref
    loss, norm, valid, params, _ = got
    assert valid == ref_valid
    dl, dn, dp = max_rel(loss, ref_loss), max_rel(norm, ref_norm), param_rel(params, ref_params)
    print(f"{what}: loss {dl:.1e}, grad norm {dn:.1e}, final params {dp:.1e}")
    assert dl <= TOL and dn <= TOL and dp <= TOL, (what, dl, dn, dp)


def _resume(run_dir, full, target, tmp_path, what):
    """Resume ``run_dir``'s step-3 checkpoint at ``target`` = (T, mode, depth, sp): steps 4-6 and the
    final parameters are the uninterrupted run's ``full``."""
    from gridshard.checkpoint.files import checkpoints_root

    step3 = os.path.join(checkpoints_root(str(run_dir)), f"step_{SAVE_AT}")
    T, mode, depth, sp = target
    loss, _, _, params, _ = _run(_config(T, mode, depth, sp=sp, resume=step3), str(tmp_path / "resumed"))
    assert len(loss) == STEPS - SAVE_AT
    dl, dp = max_rel(loss, full[0][SAVE_AT:]), param_rel(params, full[3])
    print(f"{what}: loss {dl:.1e}, final params {dp:.1e}")
    assert dl <= TOL and dp <= TOL, (what, dl, dp)


def test_3d_training_gives_the_one_process_run_and_resumes_at_2p5d(reference, run_3d, tmp_path):
    """make test's one 8-rank case: (1, 1, 8) q = 2 at ZeRO-0, 6 steps as one process (GQA, odd
    vocabulary, masked targets, clipping active), every parameter stepped whole on its rank (1/8 of
    the model); its step-3 checkpoint resumed at 2.5D (q = 2, d = 2) in the same worker pool."""
    _check_against(reference, run_3d[1], "3D (1, 1, 8) q=2 ZeRO-0")
    facts = run_3d[1][4]
    _check_layout_facts(facts)
    padding = 2 * MODEL["hidden"]                 # one zero row in the table and one in the head: 260 = ⌈259/q²⌉·q²
    assert sum(f["local_numel"] for f in facts) == sum(v.numel() for v in reference[3].values()) + padding
    for f in facts:
        assert f["stepped_numel"] == f["local_numel"], f
    _resume(run_3d[0], run_3d[1], (8, "2.5d", 2, False), tmp_path, "3D step 3 → 2.5D q=2 d=2")


@pytest.mark.wide
def test_3d_zero3_selective_recompute_gives_the_one_process_run(reference):
    """(1, 1, 8) at ZeRO-3 with selective recompute (D = 1: ZeRO-3 holds whole blocks)."""
    got = _run(_config(8, "3d", zero=3, recompute="selective"))
    _check_against(reference, got, "3D (1, 1, 8) ZeRO-3 selective")
    _check_layout_facts(got[4])


@pytest.mark.wide
def test_3d_data_parallel_zero3_gives_the_one_process_run(reference):
    """16 ranks: (2, 1, 8) at ZeRO-3: the reducer shards over the D = 2 ranks at my cube position."""
    got = _run(_config(8, "3d", zero=3, D=2))
    _check_against(reference, got, "3D (2, 1, 8) ZeRO-3")
    _check_layout_facts(got[4], D=2)
    for f in got[4]:
        n = f["local_numel"] / 2
        assert n <= f["stepped_numel"] <= n + 64, f


@pytest.mark.wide
def test_3d_context_parallel_gives_the_one_process_run(reference):
    """16 ranks: (D, C, T) = (1, 2, 8): every sequence split over the C = 2 context ranks (chunks i and
    2C − 1 − i), each running 3D on its chunks with the attention crossing the context axis (ring;
    all_to_all would replicate the rank's K/q = 1 kv head, tests/test_context_training.py); the reducer's group
    is data × context (2 ranks)."""
    got = _run(_config(8, "3d", C=2))
    _check_against(reference, got, "3D (1, C=2, 8) ring")
    for f in got[4]:
        t = f["rank"] % 8
        assert f["tensor"] == (8, t) and f["replicas"] == (2, (t, 8 + t)), f


@pytest.mark.wide
@pytest.mark.parametrize("source,target", [("3d", (4, "2d", 1, False)), ("3d", (2, "1d", 1, True)),
                                           ("one", (8, "3d", 1, False))],
                         ids=["3d-to-2d-T4", "3d-to-1d-SP-T2", "one-to-3d"])
def test_3d_checkpoint_resumes_at_other_layouts(run_3d, reference_run, source, target, tmp_path):
    """A 3D checkpoint is the canonical tensors' boxes (``ShardSpec.canonical_box`` of the cube
    coordinates): resumed from step 3 at 2D and at 1D with sequence parallelism, steps 4-6 and the
    final parameters are the uninterrupted run's; a one-process checkpoint resumes at 3D the same way."""
    run_dir, full = run_3d if source == "3d" else (reference_run[0], reference_run[1])
    _resume(run_dir, full, target, tmp_path, f"{source} step 3 → {target[1]} T={target[0]}")


@pytest.mark.wide
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_3d_hugging_face_llama_gives_the_one_process_run(tmp_path, tied):
    """A Hugging Face ``LlamaForCausalLM`` (GQA, odd vocabulary, tied or untied embeddings) at 3D
    through the same HF plan table: 6 steps as one process."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, "tie_word_embeddings": tied}))

    def cfg(*layout):
        return {**_config(*layout), "model": {"hf_config": str(path)}}

    ref = _run(cfg())
    got = _run(cfg(8, "3d"))
    assert min(ref[2]) < 8 * 16
    _check_against(ref, got, f"HF 3D q=2 {'tied' if tied else 'untied'}")
    _check_layout_facts(got[4])


@pytest.mark.wide
def test_3d_hugging_face_llama_context_parallel_gives_the_one_process_run(tmp_path):
    """16 ranks: a Hugging Face ``LlamaForCausalLM`` (tied) at (1, C = 2, 8) 3D with ring context
    attention (its global positions reach the rotary embedding as ``position_ids``): as one process."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF, "tie_word_embeddings": True}))

    def cfg(*layout, **kw):
        return {**_config(*layout, **kw), "model": {"hf_config": str(path)}}

    ref = _run(cfg())
    got = _run(cfg(8, "3d", C=2))
    _check_against(ref, got, "HF 3D (1, C=2, 8) ring tied")


@pytest.mark.wide
def test_3d_pipeline_1f1b_gives_the_one_process_run():
    """(D, P, T) = (1, 2, 8), q = 2 (16 ranks), 1F1B, tied embeddings (the last stage's TiedVocabHead3D
    reads its copy of the table, summed with the first stage's), masked targets, validation through
    the stages: cube position (i, j, l) sends its [m/q², s, h/q] block to (i, j, l) of the next stage
    (the ledger's sends = the formula); losses, gradient norms, validation losses and final parameters
    within 1e-5 of one process."""
    _check_pipeline("1f1b")


def _check_pipeline(schedule, zero=0, V=1, layers=2):
    """(1, 2, 8) under ``schedule`` (``V`` stages per rank, ``layers`` layers) against one process: the
    1F1B test's checks, the sends over the 2·V stages."""
    got = check_pipeline_run("3d", 1, schedule, V, layers, zero, f"3D P=2 {schedule} V={V} ZeRO-{zero} tied",
                             sp=False)
    for r, out in enumerate(got):
        t = r % 8
        assert out[5]["pipe"] == (t, 8 + t), out[5]                  # same cube position on both stages


@pytest.mark.wide
@pytest.mark.parametrize("schedule,V,layers,zero", [("gpipe", 1, 2, 3), ("interleaved_1f1b", 2, 4, 0),
                                                    ("zero_bubble", 2, 4, 2)],
                         ids=["gpipe-zero3", "interleaved", "zero_bubble-zero2"])
def test_3d_pipeline_schedules_give_the_one_process_run(schedule, V, layers, zero):
    """(1, 2, 8) q = 2 (16 ranks) under GPipe (ZeRO-3), interleaved 1F1B and zero bubble (V = 2 stages per
    rank over 4 layers; zero bubble at ZeRO-2): as the 1F1B test, losses, gradient norms, validation losses
    and final parameters within 1e-5 of one process (zero bubble's split backward runs each 3D layer's dual
    backward once: a repeat would double its gradients), the sends = the formula over the 2·V stages."""
    _check_pipeline(schedule, zero, V, layers)


def test_3d_config_rules_and_layout_facts():
    """One-line errors naming the valid values before any process group; the job layout's and the
    shape-only mesh's 3D facts; parallelize's 3D wording; the stage-boundary block."""
    import torch

    from gridshard.config import resolve_config
    from gridshard.errors import LayoutError
    from gridshard.job_layout import JobLayout, TensorMode
    from gridshard.mesh import ShapeMesh
    from gridshard.models import ModelConfig, Transformer
    from gridshard.nn.sharding import mesh_coords, tensor_rank_coords
    from gridshard.parallel import parallelize

    cfg = resolve_config(_config(8, "3d"), world_size=8, cuda_available=False)
    layout = JobLayout.from_config(cfg)
    assert (str(layout.mode), layout.mode.side(8), layout.layer_tensor) == ("3d", 2, 8)
    assert "T must be q³ with q >= 2 (valid: 8, 27, 64, 125, ...). Fix: use tensor=8" in \
        config_error(_config(4, "3d"), 4)
    assert "micro_batch=2 is not divisible by q²=4" in config_error(_config(8, "3d", micro_batch=2), 8)
    assert "ffn_hidden=66 is not divisible by q²=4" in \
        config_error({**_config(8, "3d"), "model": {**MODEL, "ffn_hidden": 66}}, 8)
    assert "hidden=36 is not divisible by q³=8" in \
        config_error({**_config(8, "3d"), "model": {**MODEL, "hidden": 36, "heads": 2}}, 8)
    assert "parallel.sequence_parallel=True is invalid" in config_error(_config(8, "3d", sp=True), 8)
    base = _config(8, "3d")
    # 3D leaves a rank 2 query heads and 1 k/v head: all_to_all at C = 2 replicates the k/v head, C = 4 cannot split
    assert "context_mode='all_to_all' with context=4: a rank's 2 query heads" in \
        config_error({**base, "parallel": {**base["parallel"], "context": 4, "context_mode": "all_to_all"}}, 32)
    # the shape-only mesh: rank t = (i·q + j)·q + l, tokens block i·q + j, targets block i·q + l
    for t in range(8):
        mesh = ShapeMesh(tensor=8, tensor_mode="3d", tensor_rank=t)
        i, j, l = t // 4, (t // 2) % 2, t % 2
        assert mesh.cube.coords() == {"weight": i, "input": j, "output": l}
        assert (mesh.batch_blocks, mesh.batch_index, mesh.logits_batch_index) == (4, 2 * i + j, 2 * i + l)
        assert mesh_coords(mesh)[0] == {**tensor_rank_coords(mesh, t), "expert": 0}
    # parallelize on meta: every block 1/8 of the model's (the vocabulary padded to 260 = ⌈259/q²⌉·q²)
    model_cfg = ModelConfig(vocab_size=259, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, layers=2, max_seq_len=16)
    with torch.device("meta"):
        plain = Transformer(model_cfg)
    full = sum(p.numel() for p in plain.parameters())
    model = parallelize(plain, ShapeMesh(tensor=8, tensor_mode="3d", tensor_rank=5), device="meta")
    assert sum(p.numel() for p in model.parameters()) * 8 == full + 2 * 32      # 1 padding row in table + head
    with torch.device("meta"):
        bad = Transformer(ModelConfig(vocab_size=259, hidden=32, heads=6, kv_heads=2, ffn_hidden=64, layers=1,
                                      max_seq_len=16))
    with pytest.raises(LayoutError, match="hidden=32 on a q=3 cube: 3D norm weights are stored in q³ blocks"):
        parallelize(bad, ShapeMesh(tensor=27, tensor_mode="3d"), device="meta")
    assert TensorMode("3d").boundary_block(8, False, 4, 16, 32) == (1, 16, 16)


def test_cross_entropy_3d_names_itself_in_a_bad_targetconfig_error():
    """The 3D loss runs the 2D loss's function; a bad target's error names cross_entropy_3d (a
    one-rank orientation: every axis of size 1, so no collective runs)."""
    import torch
    from types import SimpleNamespace

    from gridshard.errors import ShapeError
    from gridshard.mesh import Axis
    from gridshard.tensor.tp3d.cross_entropy import cross_entropy_3d

    one = Axis("output", 1, 0, (0,), None)
    mesh = SimpleNamespace(q=1, output=one, batch=one, batch_index=0, hidden_index=0)
    logits, targets = torch.zeros(2, 3, 5), torch.tensor([[0, 1, 7], [2, 3, 4]])
    with pytest.raises(ShapeError, match=r"^cross_entropy_3d targets: id 7 is outside the vocabulary \[0, 5\)"):
        cross_entropy_3d(logits, targets, mesh, 5)


def test_3d_run_generates_and_exports_as_the_one_process_run(reference_run, run_3d, tmp_path):
    """``gridshard generate`` and ``gridshard export --to hf`` in one process from the 3D run directory (no new
    ranks: the run fixtures' step-10 checkpoints): the exported tensors are the 3D run's gathered final parameters
    exactly (the checkpoint holds each cube block's canonical box, nothing lost or padded) and the one-process
    run's within 1e-5; the loaded models' logits agree within 1e-5; greedy and seeded sampling give the same text."""
    pytest.importorskip("safetensors")
    import torch
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from gridshard.checkpoint.files import checkpoints_root
    from gridshard.cli import main
    from gridshard.generate import load_model
    from gridshard.models.hf import export_hf_state_dict

    runs = {"one": reference_run[0], "3d": run_3d[0]}
    exported, texts = {}, {}
    for name, run_dir in runs.items():
        out = tmp_path / name
        result = CliRunner().invoke(main, ["export", str(run_dir), "--to", "hf", str(out)])
        assert result.exit_code == 0, result.output
        exported[name] = load_file(str(out / "model.safetensors"))
        for temperature in ("0", "1.0"):
            result = CliRunner().invoke(main, ["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "24",
                                               "--temperature", temperature, "--top-k", "50", "--seed", "3"])
            assert result.exit_code == 0, result.output
            texts[name, temperature] = result.stdout
    assert texts["3d", "0"] == texts["one", "0"] and texts["3d", "1.0"] == texts["one", "1.0"], texts
    assert len(texts["one", "0"]) > len("def ")
    final_3d = export_hf_state_dict(run_3d[1][3])
    assert sorted(exported["3d"]) == sorted(final_3d) == sorted(exported["one"])
    for k, v in final_3d.items():
        assert torch.equal(exported["3d"][k], v), k
    dp = param_rel(exported["3d"], exported["one"])
    models = {name: load_model(os.path.join(checkpoints_root(str(d)), f"step_{STEPS}"))[0] for name, d in runs.items()}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["max_seq_len"]), generator=gen)
    with torch.no_grad():
        ref_logits, got_logits = models["one"](tokens), models["3d"](tokens)
    dz = float((got_logits - ref_logits).norm() / ref_logits.norm())
    print(f"3D generate/export vs one process: exported tensors {dp:.1e}, logits {dz:.1e}")
    assert dp <= TOL and dz <= TOL, (dp, dz)
