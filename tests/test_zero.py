"""ZeRO-1/2/3 (``train.zero``) against ZeRO-0 and the formulas of :mod:`gridshard.theory.zero`.

* Equivalence: the same run at every stage gives the same per-step losses and gradient
  norms as ZeRO-0 (fp32, ≤ 1e-5 relative; they differ only in summation order:
  reduce-scatter instead of all-reduce), with accumulation (2 micro-batches per data rank),
  clipping active, a vocabulary and rows that D does not divide (padding), tied embeddings,
  1D + SP with full recompute, 2D on a 2×2 grid × D=2, and two 1F1B stages × D=2 with the
  tied embedding split over the first and last stage (4 micro-batches: ZeRO-2/3 reduce-scatter
  each one inside the schedule's backward, the tied root once after the cross-stage sum).
* Memory: the tensors a rank holds at the end of a step — the distinct storages of the
  parameters, gradients, optimizer state and ZeRO's buffers — equal
  :func:`~gridshard.theory.memory.model_state_bytes` exactly.
* Communication: the data axis's ledger equals :func:`~gridshard.theory.zero.zero_step_comm`
  (calls and payload per op), plus the clipping norm's 8-byte all-reduce per step.
* Checkpoints: a ZeRO-3 D=4 checkpoint resumes at ZeRO-0 D=2 × T=2 and back, continuing the
  uninterrupted run; at the same layout the resume is bit-exact.
* Offload: HostAdamW steps like (fused) AdamW, bit for bit, on the CPU path.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist

from gridshard.checkpoint.files import checkpoints_root
from gridshard.checkpoint.reader import read_checkpoint
from gridshard.engine import Trainer
from gridshard.engine.memory_meter import model_state_tensor_bytes
from gridshard.errors import ConfigError
from gridshard.testing import run_on_ranks
from gridshard.testing.compare import max_rel_tensors
from gridshard.testing.train_cache import train_on_ranks
from gridshard.theory.memory import model_state_bytes
from gridshard.theory.zero import sharded_accumulation, unit_padded_numel, zero_step_comm

# vocabulary 257 and hidden 48: rows that D=4 does not divide (padding in the flat buffers)
ODD = {"preset": None, "vocab_size": 257, "hidden": 48, "layers": 2, "heads": 4, "kv_heads": 2,
       "ffn_hidden": 120, "max_seq_len": 64, "tie_embeddings": True}
BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "train": {"global_batch": 8, "micro_batch": 1, "steps": 4, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "grad_clip": 0.5, "log_interval": 1, "seed": 5}}
LAYOUTS = {  # name: (D, T, mode, sp, model, train overrides)
    "D4-none-odd-tied": (4, 1, "none", False, ODD, {}),
    "D2-T2-1d-SP-full": (2, 2, "1d", True, None, {"recompute": "full"}),
    "D2-T4-2d": (2, 4, "2d", False, None, {"micro_batch": 2, "steps": 3}),
    "D2-P2-1f1b-tied": (2, 1, "none", False, {**ODD, "vocab_size": 256}, {}),
}
PIPELINE = {"D2-P2-1f1b-tied": {"pipeline": 2, "pipeline_schedule": "1f1b"}}
RTOL = 1e-5


def _cfg(D, T, mode, sp, model, train, pipeline=None, **more):
    return {**BASE, "model": model or BASE["model"],
            "parallel": {"data": D, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp, **(pipeline or {})},
            "train": {**BASE["train"], **train, **more}}


def held_model_state(trainer) -> dict:
    """Bytes of parameters, gradients and AdamW state this rank holds now: the distinct storages
    of the parameters, their gradients, the optimizer state and ZeRO's own buffers (flat shards,
    reduced gradient segments; shards and their gradients are views into those or the
    parameters), each counted once."""
    got = model_state_tensor_bytes(trainer.model, trainer.optimizer, trainer.reducer.memory_tensors())
    return {"optimizer": got["optimizer"], "total": got["params"] + got["grads"] + got["optimizer"] + got["extra"]}


def _numels(blocks, unit) -> list:
    return [math.prod(shape) for shape, u in blocks if u == unit]


def _stages_body(cfg):
    """Every stage in turn on the same ranks: losses, grad norms, held vs formula bytes at the
    end of the run, and the data axis's ledger per step vs the formula."""
    out = {}
    for stage in (0, 1, 2, 3):
        c = {**cfg, "train": {**cfg["train"], "zero": stage}}
        trainer = Trainer(c, progress=False)
        losses = trainer.run()
        steps = c["train"]["steps"]
        per_step = {}
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            calls, payload = trainer.ledger.count(op, "data"), trainer.ledger.payload_bytes(op, "data")
            assert calls % steps == 0 and payload % steps == 0, (op, calls, payload)
            per_step[op] = (calls // steps, payload // steps)
        held = held_model_state(trainer)
        D, r = trainer.mesh.data.size, trainer.mesh.data.rank
        if stage:       # the units (decoder layers, root) with their parameters' local shapes, in order
            units = trainer.reducer.units
            blocks = [(tuple(p.shape), None if u.name == "root" else i) for i, u in enumerate(units) for p in u.params]
        else:
            blocks = [(tuple(p.shape), None) for p in trainer.params]
        st = model_state_bytes(blocks, stage, D, r)
        want_state = {"optimizer": st.optimizer, "total": st.held}
        if stage:
            layers = [unit_padded_numel(_numels(blocks, i), D) for i, u in enumerate(units)
                      if u.name != "root"]
            root = sum(unit_padded_numel(_numels(blocks, None), D) for u in units if u.name == "root")
            micro = c["train"]["global_batch"] // (D * c["train"]["micro_batch"])
            p = trainer.cfg.parallel                                  # ZeRO-2/3 reduce every micro-batch
            sharded = sharded_accumulation(stage, D, p.pipeline, p.pipeline_schedule)
            tied_root = trainer.reducer.defer_root                    # a pipeline's tied copy: once, after the sum
            vol = zero_step_comm(layers, root, D, stage, micro_batches=micro, sharded_accumulation=sharded,
                                 tied_root=tied_root)
            want_comm = {op: (vol.count(op), vol.payload_bytes(op)) for op in ("all_gather", "reduce_scatter")}
            want_comm["all_reduce"] = (1, 8) if D > 1 else (0, 0)     # the shards' squared norm
        else:
            numel = sum(p.numel() for p in trainer.params)
            want_comm = {"all_reduce": (len(trainer.reducer.units), 4 * numel), "all_gather": (0, 0),
                         "reduce_scatter": (0, 0)}
        out[stage] = (losses, [h["grad_norm"] for h in trainer.history], held, want_state, per_step, want_comm)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_stages_equal_zero0_memory_and_traffic_match_theory(name):
    D, T, mode, sp, model, train = LAYOUTS[name]
    pipe = PIPELINE.get(name)
    P = pipe["pipeline"] if pipe else 1
    per_rank = run_on_ranks(D * T * P, _stages_body, _cfg(D, T, mode, sp, model, train, pipe), timeout=400)
    for rank, out in enumerate(per_rank):
        ref_losses, ref_norms = out[0][0], out[0][1]
        for stage, (losses, norms, held, want_state, step_ledger, want_comm) in out.items():
            assert len(losses) == len(ref_losses)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            assert rel < RTOL, (name, stage, rel)
            assert max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)) < RTOL, (name, stage)
            assert held == want_state, (name, rank, stage, held, want_state)
            assert step_ledger == want_comm, (name, rank, stage, step_ledger, want_comm)
        # sharding saves what the table says: ZeRO-3 holds about 1/D of ZeRO-0's model state
        z0, z3 = out[0][2]["total"], out[3][2]["total"]
        assert z3 < z0 / D * 1.1, (name, z0, z3)


def test_zero3_traffic_is_one_and_a_half_allreduces():
    """On a ring, ZeRO-1/2 move the all-reduce's bytes and ZeRO-3 (one micro-batch) 1.5× of
    them (the root unit's backward gather saved), from the formula alone."""
    units, root, D = [1000, 1000, 1000], 400, 4
    allreduce_wire = 2 * (D - 1) / D * sum(units + [root]) * 4
    assert zero_step_comm(units, root, D, 1).wire_bytes() == pytest.approx(allreduce_wire)
    z3 = zero_step_comm(units, root, D, 3).wire_bytes()
    assert z3 == pytest.approx(allreduce_wire * 1.5 - (D - 1) / D * root * 4)


# ---- ZeRO-3 prefetch (issue 27) ----------------------------------------------------------
def _prefetch_body(overlap):
    """One ZeRO-3 step on 3 layers with the gathers, layer forwards and first layer gradients
    in one timeline; the losses and the data ledger."""
    from gridshard.comm import collectives

    cfg = _cfg(2, 1, "none", False, {**ODD, "layers": 3}, {"zero": 3, "steps": 1, "global_batch": 4,
                                                          "micro_batch": 2, "overlap_grad_reduce": overlap})
    trainer = Trainer(cfg, progress=False)
    units, events = trainer.reducer.units, []
    layers = [u for u in units if u.name != "root"]
    name_of = {id(u.param_buffer): u.name for u in units}
    real = collectives.all_gather_into

    def spy(out, x, axis, async_op=False, **staging):
        events.append(("gather", name_of[id(out)]))
        return real(out, x, axis, async_op=async_op, **staging)

    for u in layers:
        u.modules[0].register_forward_pre_hook(
            lambda m, a, n=u.name: events.append(("fwd", n, sum(v.gathered for v in layers))))
        for p in u.params:
            p.register_hook(lambda g, n=u.name: events.append(("grad", n)) if ("grad", n) not in events else None)
    collectives.all_gather_into = spy
    try:
        losses = trainer.run()
    finally:
        collectives.all_gather_into = real
    ledger = (trainer.ledger.count("all_gather", "data"), trainer.ledger.payload_bytes("all_gather", "data"))
    return losses, events, [u.name for u in layers], ledger


def test_zero3_prefetch_issues_the_next_gather_first_and_changes_nothing_else():
    """With prefetch (overlap on) layer i+1's forward gather is issued before layer i computes
    and layer i's backward gather before layer i+1's gradients; at most two layers are gathered;
    the same gathers (ledger) and bitwise the same losses as without prefetch."""
    on, off = (run_on_ranks(2, _prefetch_body, overlap, timeout=240)[0] for overlap in (True, False))
    assert on[0] == off[0] and on[3] == off[3]
    for (losses, events, names, _), prefetch in ((on, True), (off, False)):
        first_step = events[:events.index(("grad", names[0])) + 1]
        at = lambda e: first_step.index(e)                                           # noqa: E731
        fwd = {e[1]: i for i, e in enumerate(first_step) if e[0] == "fwd"}
        gathers = [i for i, e in enumerate(first_step) if e[0] == "gather"]
        for a, b in zip(names, names[1:]):
            forward_b = next(i for i in gathers if first_step[i][1] == b)
            backward_a = [i for i in gathers if first_step[i][1] == a][1]
            assert (forward_b < fwd[a]) == prefetch, (prefetch, a, b, first_step)
            assert (backward_a < at(("grad", b))) == prefetch, (prefetch, a, b, first_step)
        assert max(e[2] for e in first_step if e[0] == "fwd") == (2 if prefetch else 1)
    assert [e for e in on[1] if e[0] == "gather"] == [e for e in off[1] if e[0] == "gather"]


# ---- ZeRO-2 sharded gradient accumulation (issue 23) -------------------------------------
def _accumulation_body(stage):
    """Two steps of 4 micro-batches per data rank: losses, norms and (ZeRO-2) the largest and
    the between-micro-batch bytes of live gradient buffers, with the full gradient's and the
    formula's bytes."""
    from gridshard.theory.memory import zero_gradient_transient

    cfg = _cfg(2, 1, "none", False, {**ODD, "layers": 4}, {"zero": stage, "steps": 2, "micro_batch": 1})
    trainer = Trainer(cfg, progress=False)
    if not stage:
        return trainer.run(), [h["grad_norm"] for h in trainer.history], None
    units, seen = trainer.reducer.units, {"during": [], "between": []}
    live = lambda: sum(u.grad_buffer.untyped_storage().nbytes() for u in units)     # noqa: E731
    for u in units:
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda _p: seen["during"].append(live()))
    trainer.model.register_forward_pre_hook(lambda m, a: seen["between"].append(live()))
    losses = trainer.run()
    blocks = [(tuple(p.shape), None if u.name == "root" else i) for i, u in enumerate(units) for p in u.params]
    full = 4 * sum(unit_padded_numel(_numels(blocks, i if u.name != "root" else None), 2) for i, u in enumerate(units))
    bound = zero_gradient_transient(blocks, 2, 2, micro_batches=4)
    return losses, [h["grad_norm"] for h in trainer.history], (max(seen["during"]), max(seen["between"]), full, bound)


def test_zero2_accumulates_sharded_gradients_and_equals_zero0():
    """ZeRO-2 with 4 micro-batches reduce-scatters each one into the sharded accumulator: the
    same losses and norms as ZeRO-0 (fp32, 1e-6), the live gradient buffers never reach the full
    gradient and stay within the formula, and between micro-batches less than half survives."""
    (l0, n0, _), (l2, n2, mem) = (run_on_ranks(2, _accumulation_body, stage, timeout=240)[0] for stage in (0, 2))
    assert max(abs(a - b) / abs(b) for a, b in zip(l2 + n2, l0 + n0)) < 1e-6, (l0, l2, n0, n2)
    during, between, full, bound = mem
    assert during <= bound < full, mem
    assert between < full / 2, mem


# ---- checkpoints across stages and layouts --------------------------------------------------
CK_MODEL = {**ODD, "vocab_size": 260}


def _ck_cfg(D, T, mode, zero, **train):
    return _cfg(D, T, mode, False, CK_MODEL, {"global_batch": 4, "micro_batch": 4 // D, "steps": 6,
                                              "save_interval": 3, "zero": zero, **train})


def _ck_body(cfg, run_dir):
    losses = Trainer(cfg, run_dir=run_dir, progress=False).run()
    return losses if dist.get_rank() == 0 else None


def _ck_run(cfg, run_dir):
    return train_on_ranks(_ck_body, cfg, str(run_dir), timeout=240)[0]


def _final(run_dir):
    return read_checkpoint(os.path.join(checkpoints_root(str(run_dir)), "step_6"))[1]


def test_checkpoints_reshard_between_zero3_d4_and_zero0_d2_t2(tmp_path):
    z3 = (4, 1, "none", 3)
    z0 = (2, 2, "1d", 0)
    runs = {}
    for name, lay in (("z3", z3), ("z0", z0)):
        runs[name] = _ck_run(_ck_cfg(*lay), tmp_path / name)
    step3 = {n: os.path.join(checkpoints_root(str(tmp_path / n)), "step_3") for n in runs}
    # the same layout: bit for bit
    same = _ck_run(_ck_cfg(*z3, resume=step3["z3"]), tmp_path / "z3-again")
    assert same == runs["z3"][3:]
    assert all(torch.equal(a, b) for a, b in zip(_final(tmp_path / "z3-again").values(),
                                                 _final(tmp_path / "z3").values()))
    # across stages and layouts, both ways: the continuation of the source's run
    for src, dst in (("z3", z0), ("z0", z3)):
        losses = _ck_run(_ck_cfg(*dst, resume=step3[src]), tmp_path / f"{src}-to-{dst[3]}")
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, runs[src][3:]))
        assert len(losses) == 3 and rel < RTOL, (src, dst, rel)
        assert max_rel_tensors(_final(tmp_path / f"{src}-to-{dst[3]}"), _final(tmp_path / src), dtype=None,
                               floor=1e-30, floating_only=True) < 1e-3, (src, dst)


@pytest.mark.wide
def test_pipeline_tied_zero2_checkpoint_writes_the_tied_weight_once(tmp_path):
    """Two GPipe stages × D=2 at ZeRO-2 with the tied embedding on the first and last stage: the
    two copies sit in different units (different element ranges), so only the first stage's is
    written; resumed at ZeRO-0 D=2 without a pipeline, the run continues the uninterrupted one."""
    pipe = {"pipeline": 2, "pipeline_schedule": "gpipe"}
    src = _ck_cfg(2, 1, "none", 2)
    src["parallel"].update(pipe)
    runs = run_on_ranks(4, _ck_body, src, str(tmp_path / "p2"), timeout=240)[0]
    step3 = os.path.join(checkpoints_root(str(tmp_path / "p2")), "step_3")
    losses = _ck_run(_ck_cfg(2, 1, "none", 0, resume=step3), tmp_path / "p1")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, runs[3:])) < RTOL, (losses, runs)


# ---- offload and config rules ------------------------------------------------------------
def test_host_adamw_steps_like_adamw_bit_for_bit():
    from gridshard.zero.offload import HostAdamW

    torch.manual_seed(0)
    a = [torch.randn(5, 3), torch.randn(7)]
    b = [t.clone() for t in a]
    groups = lambda ts: [{"params": [ts[0]], "weight_decay": 0.1}, {"params": [ts[1]], "weight_decay": 0.0}]
    plain = torch.optim.AdamW(groups(a), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)   # the host's step
    host = HostAdamW(groups(b), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(4):
        grads = [torch.randn_like(t) for t in a]
        for opt, ts in ((plain, a), (host, b)):
            for t, g in zip(ts, grads):
                t.grad = g.clone()
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (step + 1)
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(host.state_for(b[0])["exp_avg_sq"], plain.state[a[0]]["exp_avg_sq"])


def test_offload_on_cpu_is_accepted_and_says_it_changes_nothing():
    from gridshard.zero import offload_note

    assert "changes nothing" in offload_note(torch.device("cpu"))
    assert offload_note(torch.device("cuda")) is None


def test_zero3_with_the_zero_bubble_schedule_is_refused():
    from gridshard.config import resolve_config

    cfg = {**BASE, "model": {**ODD, "layers": 4},
           "parallel": {"data": 1, "pipeline": 2, "tensor": 1, "pipeline_schedule": "zero_bubble", "virtual_stages": 2},
           "train": {**BASE["train"], "zero": 3}}
    with pytest.raises(ConfigError, match="train.zero=3.*zero-bubble.*Fix"):
        resolve_config(cfg, world_size=2)


# ---- sharded accumulation with pipeline stages (issue 23) ----------------------------------
def test_sharded_accumulation_with_pipeline_stages_drops_the_predicted_bytes_by_the_formula():
    """One home decides sharded accumulation (:func:`~gridshard.theory.zero.sharded_accumulation`):
    ZeRO-2/3 at D > 1 with overlap, at P = 1 and under GPipe / 1F1B / interleaved 1F1B, not
    zero bubble, ZeRO-0/1, D = 1 or ``overlap_grad_reduce=false``. At P = 2 (4 layers per rank,
    A = 8) the predicted peak of ZeRO-2 then drops by the whole gradient buffers less the units
    in flight: 4·(ΣL_u − (L_root + L_(1) + L_(2) + L_(3))) = 4·L of one layer here, as the formula."""
    from gridshard.models import ModelConfig
    from gridshard.parallel.rank_blocks import rank_parameter_blocks
    from gridshard.theory.memory import predict_rank_memory, zero_gradient_transient

    for schedule, want in (("gpipe", True), ("1f1b", True), ("interleaved_1f1b", True), ("zero_bubble", False)):
        assert sharded_accumulation(2, 2, 2, schedule) == sharded_accumulation(3, 2, 2, schedule) == want
    assert sharded_accumulation(2, 2) and not sharded_accumulation(1, 2) and not sharded_accumulation(2, 1)
    assert not sharded_accumulation(3, 4, 2, "1f1b", overlap=False)
    cfg = ModelConfig(vocab_size=97, hidden=64, layers=8, heads=4, kv_heads=2, ffn_hidden=96, max_seq_len=16)
    blocks = rank_parameter_blocks(cfg, layer_ids=[0, 1, 2, 3], has_head=False)
    kw = dict(data=2, zero=2, micro_batch=1, seq_len=8, n_microbatches=8, pipeline=2, pipeline_rank=0,
              layer_ids=[0, 1, 2, 3], blocks=blocks)
    whole = predict_rank_memory(cfg, overlap_grad_reduce=False, **kw)
    sharded = predict_rank_memory(cfg, **kw)
    assert predict_rank_memory(cfg, schedule="zero_bubble", **kw).total == whole.total
    units = {}
    for b in blocks:
        units.setdefault(b.layer if b.in_decoder_layer else "root", []).append(b.numel)
    L = {u: unit_padded_numel(n, 2) for u, n in units.items()}
    layers = sorted((v for u, v in L.items() if u != "root"), reverse=True)
    drop = 4 * (sum(L.values()) - (L["root"] + sum(layers[:3])))
    assert drop == 4 * layers[3] > 0
    assert whole.transient - sharded.transient == drop == (
        zero_gradient_transient(blocks, 2, 2, 8, sharded_accumulation=False)
        - zero_gradient_transient(blocks, 2, 2, 8, sharded_accumulation=True))
    assert whole.total - sharded.total == drop
