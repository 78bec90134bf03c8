"""Pipeline parallelism: the same training run at every (D, P, T, mode) and schedule, the
bytes between stages equal to the formula, 1F1B's bounded activations, the bubble reported,
checkpoints across P, and bad pipeline layouts refused before any process group exists.

Reference: the one-process run (D, P, T) = (1, 1, 1) of the same config (a 4-layer tiny
model, so P = 4 stages each hold one layer). fp32; the layouts differ only in summation
order (measured ≤ 7e-8 relative on the loss over 8 steps). The D = 2 layouts run ZeRO-2
(GPipe) and ZeRO-3 (1F1B) with 4 micro-batches: sharded accumulation with pipeline stages
(issue 23), each micro-batch reduce-scattered in the schedule's backward; after every
micro-batch's backward but the last no unit holds gradients not yet reduced or in flight.
"""
import os

import pytest
import torch.distributed as dist

from gridshard.config import resolve_config
from gridshard.engine import Trainer
from gridshard.errors import ConfigError
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks
from gridshard.testing.train_cache import train_on_ranks
from gridshard.theory.pipeline import boundary_bytes, peak_in_flight, step_send_bytes
from gridshard.torch_private import _recv_buffer
from gridshard.zero.data_parallel import MAX_IN_FLIGHT

BASE = {"model": {"preset": "tiny", "layers": 4}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "train": {"global_batch": 8, "micro_batch": 2, "steps": 8, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5,
                  "log_interval": 4, "seed": 7}}
LOSS_RTOL = 1e-5


def _cfg(D, P, T, mode, sp=False, schedule="1f1b", V=1, tied=False, **train):
    return {**BASE, "model": {**BASE["model"], "tie_embeddings": tied},
            "parallel": {"data": D, "pipeline": P, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp,
                         "pipeline_schedule": schedule, "virtual_stages": V},
            "train": {**BASE["train"], "micro_batch": 8 // (4 * D) if D > 1 else 2, **train}}


def _gather_pipeline_state(trainer):
    """The canonical state of the whole model: each stage's tensors, merged over the pipeline."""
    state = gathered_state_dict(trainer.model)
    if trainer.mesh.pipeline.size == 1:
        return state
    parts = [None] * trainer.mesh.pipeline.size
    dist.all_gather_object(parts, state, group=trainer.mesh.pipeline.group)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def _train_body(cfg, run_dir=None):
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    between = _probe_between_micro_batches(trainer) if trainer.pipeline is not None else None
    losses = trainer.run()
    state = _gather_pipeline_state(trainer)
    extra = None
    if trainer.pipeline is not None:
        m = trainer.pipeline.meter
        sends = trainer.ledger.entries.get(("send", "pipeline"))
        extra = {"stages": trainer.pipeline.stage_indices, "peak_in_flight": m.peak_in_flight,
                 "peak_saved": m.peak_saved_bytes, "send_bytes": sends.payload_bytes if sends else 0,
                 "bubble": [h["bubble_share"] for h in trainer.history], "between": between,
                 "sharded": trainer.reducer.sharded_accumulation}
    return losses, state, extra


def _probe_between_micro_batches(trainer) -> list:
    """After each stage backward of a micro-batch before the step's last: (units whose gradients
    are neither reduced nor in flight, units whose gradient buffer is live, units in flight); a
    tied root waiting for the cross-stage sum (``defer_root``) left out."""
    reducer, seen = trainer.reducer, []
    units = [u for u in reducer.units if not (reducer.defer_root and u.name == "root")]
    sched, A = trainer.pipeline.schedule, trainer.layout.micro_batches
    for stage in getattr(sched, "_stages", None) or [sched._stage]:
        def after(chunk, *args, _bwd=stage.backward_one_chunk, **kwargs):
            out = _bwd(chunk, *args, **kwargs)
            if chunk < A - 1:
                seen.append((sum(u.unreduced for u in units), sum(u.grads_live for u in units),
                             sum(u.pending is not None for u in units)))
            return out
        stage.backward_one_chunk = after
    return seen


def _run(cfg, run_dir=None):
    return train_on_ranks(_train_body, cfg, run_dir, timeout=300)


@pytest.fixture(scope="module")
def references():
    return {tied: _run(_cfg(1, 1, 1, "none", tied=tied))[0] for tied in (False, True)}


# (D, P, T, mode, sp, schedule, V, tied): every layout of the issue, the schedules spread over them
LAYOUTS = {
    "D1-P2-none-1f1b": (1, 2, 1, "none", False, "1f1b", 1, False),
    "D1-P4-none-gpipe": (1, 4, 1, "none", False, "gpipe", 1, False),
    "D1-P2-none-interleaved-tied": (1, 2, 1, "none", False, "interleaved_1f1b", 2, True),
    "D1-P2-T2-1d-tied": (1, 2, 2, "1d", False, "1f1b", 1, True),
    "D1-P2-T2-1d-SP-interleaved": (1, 2, 2, "1d", True, "interleaved_1f1b", 2, False),
    "D2-P2-none-gpipe-tied": (2, 2, 1, "none", False, "gpipe", 1, True),
    "D1-P2-T4-2d": (1, 2, 4, "2d", False, "1f1b", 1, False),
    "D2-P2-T2-1d-tied": (2, 2, 2, "1d", False, "1f1b", 1, True),
}


ZERO = {"D2-P2-none-gpipe-tied": 2, "D2-P2-T2-1d-tied": 3}     # sharded accumulation with stages


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_run_equals_one_device(references, name):
    D, P, T, mode, sp, schedule, V, tied = LAYOUTS[name]
    ref_losses, ref_state, _ = references[tied]
    per_rank = _run(_cfg(D, P, T, mode, sp, schedule, V, tied, zero=ZERO.get(name, 0)))
    losses, state, extra = per_rank[0]
    rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    assert len(losses) == len(ref_losses) and rel < LOSS_RTOL, (name, rel)
    assert state.keys() == ref_state.keys()
    worst = max(float((state[k] - ref_state[k]).norm() / ref_state[k].norm()) for k in ref_state)
    assert worst < 1e-4, (name, worst)
    assert all(b is not None and 0.0 <= b < 1.0 for b in extra["bubble"]), extra["bubble"]
    for _, _, ex in per_rank if name in ZERO else ():
        # no full gradient survives a micro-batch: every unit reduced or in flight, ≤ MAX_IN_FLIGHT live
        assert ex["sharded"] and ex["between"], (name, ex["between"])
        assert all(stale == 0 and live == flying <= MAX_IN_FLIGHT for stale, live, flying in ex["between"]), \
            (name, ex["between"])


def _zero_schedules_body(cfg, runs):
    """One trainer per (schedule, virtual stages, ZeRO stage) of ``runs`` on the same ranks:
    ``_train_body``'s losses, state and extras for each."""
    out = []
    for schedule, V, zero in runs:
        c = {**cfg, "parallel": {**cfg["parallel"], "pipeline_schedule": schedule, "virtual_stages": V},
             "train": {**cfg["train"], "zero": zero}}
        out.append(_train_body(c))
    return out


@pytest.mark.wide
def test_interleaved_zero23_accumulate_sharded_and_zero_bubble_keeps_whole_gradients(references):
    """(D, P, T) = (2, 2, 1), 4 micro-batches per data rank: interleaved 1F1B (V = 2) at ZeRO-2 and
    ZeRO-3 reduce-scatter every micro-batch (no unit unreduced between micro-batches) and equal
    one device (fp32, 1e-5 per step); zero bubble at ZeRO-2 keeps whole gradients to ``sync()``
    (its weight pass bypasses the post-accumulate-grad hooks) and equals one device too."""
    runs = [("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 2, 3), ("zero_bubble", 2, 2)]
    per_rank = run_on_ranks(4, _zero_schedules_body, _cfg(2, 2, 1, "none"), runs, timeout=600)
    ref_losses, ref_state, _ = references[False]
    for (schedule, _, zero), (losses, state, extra) in zip(runs, per_rank[0]):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < LOSS_RTOL, (schedule, zero)
        worst = max(float((state[k] - ref_state[k]).norm() / ref_state[k].norm()) for k in ref_state)
        assert worst < 1e-4, (schedule, zero, worst)
    for rank_runs in per_rank:
        for (schedule, _, zero), (_, _, extra) in zip(runs, rank_runs):
            assert extra["sharded"] == (schedule != "zero_bubble"), (schedule, zero)
            if extra["sharded"]:
                assert extra["between"] and all(stale == 0 and live == flying <= MAX_IN_FLIGHT
                                                for stale, live, flying in extra["between"]), extra["between"]


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of the tensors alive in this process."""
    import gc

    import torch

    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta":
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return sum(storages.values())


def _ledger_body(cfg):
    """Losses, the ledger, and the live tensor bytes at the start of each step's schedule."""
    trainer = Trainer(cfg, progress=False)
    schedule, live = trainer.pipeline.schedule, []

    def step(*args, _step=schedule.step, **kwargs):
        live.append(_live_tensor_bytes())
        return _step(*args, **kwargs)
    schedule.step = step
    losses = trainer.run()
    return losses, {k: (v.count, v.payload_bytes) for k, v in trainer.ledger.entries.items() if v.count}, live


def test_zero_bubble_is_exact_and_repeats_no_collective(references):
    """Zero bubble's deferred weight pass neither changes the result nor re-runs the tensor-
    parallel layers' backward collectives: same losses as one device, and the same ledger as
    interleaved 1F1B (1D, T = 2, P = 2, V = 2). Neither schedule keeps anything of a step: the
    live tensor bytes at the start of step 3 are those of step 2, within 1 kB (zero bubble's input pass
    keeps its graph for the weight pass, and a saved-tensor hook returning the tensor itself kept
    the nodes only the input pass runs through, and all they saved, for good: gridshard.nn.saved)."""
    cfg = _cfg(1, 2, 2, "1d", False, "interleaved_1f1b", 2, steps=3)
    inter = run_on_ranks(4, _ledger_body, cfg, timeout=300)
    zb = run_on_ranks(4, _ledger_body, {**cfg, "parallel": {**cfg["parallel"], "pipeline_schedule": "zero_bubble"}},
                      timeout=300)
    assert max(abs(a - b) / b for a, b in zip(zb[0][0], references[False][0][:3])) < LOSS_RTOL
    assert zb[0][1] == inter[0][1] and zb[0][1][("all_reduce", "tensor")][0] > 0
    for name, per_rank in (("interleaved_1f1b", inter), ("zero_bubble", zb)):
        for rank, (_, _, live) in enumerate(per_rank):
            assert len(live) == 3 and abs(live[2] - live[1]) <= 1024, (name, rank, live)   # a few scalars


def _schedule_order(cfg):
    """Per pipeline rank of the built schedule's action list (``pipeline_order``; None = an idle slot):
    (slots, idle slots, most chunks whose forward ran and weight pass did not)."""
    trainer = Trainer(cfg, progress=False)
    out = {}
    for rank, actions in trainer.pipeline.schedule.pipeline_order.items():
        alive = peak = 0
        for a in actions:
            kind = None if a is None else a.computation_type.value
            alive += {"F": 1, "W": -1}.get(kind, 0)
            peak = max(peak, alive)
        out[rank] = (len(actions), actions.count(None), peak)
    return out


def test_zero_bubble_order_has_the_formula_s_bubble_and_in_flight():
    """The zero-bubble schedule gridshard builds (P = 2, V = 2, A = 4), read from PyTorch's own action
    list with F, I and W one slot each: 3·V·A + P − 1 slots of which P − 1 idle on every rank, so
    the bubble is :func:`gridshard.theory.pipeline.bubble_fraction`'s (P−1)/(3VA + P − 1), and at
    most V·P chunks alive between a forward and its weight pass: ``zero_bubble_in_flight`` = P
    micro-batches of the rank's layers."""
    from gridshard.theory.pipeline import bubble_fraction, zero_bubble_in_flight

    P, V, A = 2, 2, 4
    order = run_on_ranks(2, _schedule_order, _cfg(1, P, 1, "none", False, "zero_bubble", V))[0]
    assert sorted(order) == list(range(P))
    for slots, idle, alive in order.values():
        assert (slots, idle) == (3 * V * A + P - 1, P - 1)
        assert idle / slots == pytest.approx(bubble_fraction(P, A, "zero_bubble", V))
        assert -(-alive // V) == zero_bubble_in_flight(P, V, A) == P


def _trainer_prediction(cfg):
    """This rank's predicted memory as the trainer makes it, beside the planner's for the same rank."""
    from gridshard.config import load_config
    from gridshard.planner.cost_memory import rank_memories
    from gridshard.planner.fit import config_layout

    trainer = Trainer(cfg, progress=False)
    loaded = load_config(cfg)
    planner = rank_memories(loaded.model.resolve(), config_layout(loaded), loaded.data.seq_len,
                            loaded.train.global_batch)[trainer.mesh.pipeline.rank]
    return [(m.activations, m.comm_buffers, m.details["in_flight"], m.details["stage_buffers"])
            for m in (trainer.predicted_mem, planner)]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_the_trainer_prices_virtual_stages_as_the_planner_does(schedule):
    """P = 2, V = 2, A = 4: the trainer's own prediction (``predicted_mem_bytes``) holds the schedule's
    micro-batches in flight and the V − 1 further stages' receive buffers, as the planner's does (one
    home: :func:`gridshard.theory.memory.predict.with_virtual_stages`); before, it priced 1F1B's."""
    from gridshard.theory.pipeline import interleaved_in_flight, zero_bubble_in_flight

    for rank, (trainer, planner) in enumerate(run_on_ranks(2, _trainer_prediction, _cfg(1, 2, 1, "none", False,
                                                                                         schedule, 2))):
        assert trainer == planner, (rank, trainer, planner)
        held = interleaved_in_flight(rank, 2, 2, 4) if schedule == "interleaved_1f1b" else zero_bubble_in_flight(2, 2, 4)
        assert trainer[2] == max(held, 2 - rank)


def _receive_buffers(cfg):
    """The most input receive buffers, output-gradient receive buffers and boundary blocks kept
    after their send (stage outputs the stages keep for their backward, and every sent output or
    input gradient whose send still holds it: distinct storages) this rank's stages held at once
    over the run (sampled around every chunk's forward and backward passes), and the rank's
    micro-batches in flight."""
    trainer = Trainer(cfg, progress=False)
    schedule = trainer.pipeline.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    most, sent = [0, 0, 0], []

    def real(infos):                 # a model-level input has no buffer (torch_private._recv_buffer: 2.11 and 2.13)
        buffers = (_recv_buffer(i) for chunk in infos.values() for i in chunk)
        return sum(b is not None and b.device.type != "meta" for b in buffers)

    def kept():
        outputs = {out.untyped_storage().data_ptr() for s in stages if not s.is_last
                   for outs, _ in s.fwd_cache.values() for out in (outs if isinstance(outs, tuple) else (outs,))}
        # a send's tensor is held by this list and, until the schedule lets go of the send, by its Work
        held = {t.untyped_storage().data_ptr() for t in sent if t._use_count() > 1 and t.untyped_storage().nbytes()}
        return len(outputs | held)

    def sample():
        now = [sum(real(s.args_recv_info) for s in stages), sum(real(s.grad_recv_info) for s in stages), kept()]
        most[:] = map(max, most, now)

    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            def probed(*args, _run=getattr(stage, name), **kwargs):
                sample()
                out = _run(*args, **kwargs)
                sample()
                return out
            setattr(stage, name, probed)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            def recorded(chunk, _get=getattr(stage, name)):
                ops = _get(chunk)
                sent.extend(op.tensor for op in ops)
                return ops
            setattr(stage, name, recorded)

    def step(*args, _step=schedule.step, **kwargs):
        sent.clear()                 # the step's last wait let go of every send
        return _step(*args, **kwargs)
    schedule.step = step
    trainer.run()
    return tuple(most), trainer.pipeline.meter.peak_in_flight


@pytest.mark.parametrize("schedule,P,V", [("1f1b", 4, 1), ("zero_bubble", 2, 2),
                                          pytest.param("interleaved_1f1b", 2, 2, marks=pytest.mark.wide),
                                          pytest.param("interleaved_1f1b", 4, 2, marks=pytest.mark.wide),
                                          pytest.param("zero_bubble", 4, 2, marks=pytest.mark.wide)])
def test_receive_buffers_live_only_while_in_flight(schedule, P, V):
    """A = 16 micro-batches (two steps): torch's PipelineStage would hold 16 input and 16
    output-gradient receive buffers per stage; gridshard's stages receive just in time
    (``torch_private.receive_just_in_time``), so a stage holds an input buffer per micro-batch in
    flight (the first layer's input), one output gradient, and one kept output per micro-batch in
    flight: the memory model's [not last]·(in_flight + 1)·B
    (:func:`gridshard.theory.pipeline.stage_buffer_bytes`). V stages: torch's runtime kept every
    send to the step's end (up to 2·A·V = 64 blocks here; 48 measured at P = 2); given back once proven done
    (:mod:`gridshard.pipeline.send_release`), a rank holds V·held + 1 + ``sends_held`` at most."""
    from gridshard.theory.pipeline import interleaved_in_flight, sends_held, stage_buffer_bytes, zero_bubble_in_flight

    A = 16
    cfg = _cfg(1, P, 1, "none", False, schedule, V, steps=2, log_interval=1, global_batch=2 * A)
    cfg["model"]["layers"] = max(4, P * V)
    for rank, ((inputs, grads, kept), in_flight) in enumerate(run_on_ranks(P, _receive_buffers, cfg)):
        if V == 1:
            assert in_flight == peak_in_flight(rank, P, A) == P - rank
            first, last = rank == 0, rank == P - 1
            # 1F1B lets go of a send at its next exchange: the output sent last can outlive its backward
            # by one exchange, below the peak (every micro-batch in flight holds its own output then)
            assert (inputs, grads) == (0 if first else in_flight, 0 if last else 1)
            assert kept in ((0,) if last else (in_flight, in_flight + 1)), (rank, kept, in_flight)
            assert grads + min(kept, in_flight) == stage_buffer_bytes(last, in_flight, 1)
        else:
            held = interleaved_in_flight(rank, P, V, A) if schedule == "interleaved_1f1b" else \
                zero_bubble_in_flight(P, V, A)
            bound = stage_buffer_bytes(False, V * held + sends_held(schedule, rank, P), 1)
            assert inputs <= V * held and grads + kept <= bound, (rank, inputs, grads, kept, bound)


@pytest.mark.parametrize("layout", [(1, 2, 2, "1d", True), (1, 2, 4, "2d", False)], ids=["1d-SP", "2d"])
def test_stage_sends_match_the_formula(layout):
    """The ledger's pipeline sends per rank equal A·boundary_bytes·(sends per micro-batch) per step."""
    D, P, T, mode, sp = layout
    cfg = _cfg(D, P, T, mode, sp, steps=2, log_interval=1)
    out = _run(cfg)
    A = 8 // (2 * D)
    per = boundary_bytes(mode, sp, T, 2, 32, 64)
    for losses, _, extra in out:
        assert extra["send_bytes"] == 2 * step_send_bytes(extra["stages"], P, A, per)


def test_1f1b_bounds_activations_in_flight_gpipe_does_not():
    """P = 2, A = 8 micro-batches: 1F1B's first stage holds at most P micro-batches' saved
    activations, GPipe's all 8 — measured in micro-batches and in saved bytes."""
    cfg = {**_cfg(1, 2, 1, "none", steps=1, log_interval=1), "train": {**BASE["train"], "global_batch": 16,
                                                                         "micro_batch": 2, "steps": 1}}
    one_f_one_b = _run(cfg)
    gpipe = _run({**cfg, "parallel": {**cfg["parallel"], "pipeline_schedule": "gpipe"}})
    for stage in (0, 1):
        assert one_f_one_b[stage][2]["peak_in_flight"] == peak_in_flight(stage, 2, 8, "1f1b")
        assert gpipe[stage][2]["peak_in_flight"] == peak_in_flight(stage, 2, 8, "gpipe") == 8
    ratio = gpipe[0][2]["peak_saved"] / one_f_one_b[0][2]["peak_saved"]
    assert 8 / 2 * 0.9 < ratio < 8 / 2 * 1.1, ratio


def test_checkpoint_moves_between_pipeline_and_tensor_layouts(tmp_path, references):
    """Saved at (D,P,T) = (1,2,1) at step 4, resumed at (1,1,2,1d) — and saved at (1,1,2,1d),
    resumed at (1,2,2,1d): the remaining losses are the uninterrupted run's."""
    ref_losses = references[False][0]
    a = str(tmp_path / "p2")
    _run({**_cfg(1, 2, 1, "none"), "train": {**_cfg(1, 2, 1, "none")["train"], "save_interval": 4}}, a)
    resumed = _run(_cfg(1, 1, 2, "1d", resume=os.path.join(a, "checkpoints", "step_4")), str(tmp_path / "t2"))[0]
    assert max(abs(x - y) / y for x, y in zip(resumed[0], ref_losses[4:])) < LOSS_RTOL
    b = str(tmp_path / "t2b")
    _run({**_cfg(1, 1, 2, "1d"), "train": {**_cfg(1, 1, 2, "1d")["train"], "save_interval": 4}}, b)
    resumed = _run(_cfg(1, 2, 2, "1d", resume=os.path.join(b, "checkpoints", "step_4")), str(tmp_path / "p2b"))[0]
    assert max(abs(x - y) / y for x, y in zip(resumed[0], ref_losses[4:])) < LOSS_RTOL


BAD = [
    ("more stages than layers", {"pipeline": 8}, {}, 8, ["8 stages", "model.layers=4"]),
    ("1f1b short of micro-batches", {"pipeline": 4}, {"global_batch": 4, "micro_batch": 2}, 4,
     ["1F1B needs at least P=4 micro-batches", "train.global_batch"]),
    ("virtual stages without interleaving", {"pipeline": 2, "virtual_stages": 2}, {}, 2,
     ["parallel.virtual_stages=2", "interleaved_1f1b"]),
    ("interleaving without virtual stages", {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b"}, {}, 2,
     ["needs at least 2 stages per rank"]),
    ("uneven split that does not add up", {"pipeline": 2, "stage_layers": [1, 2]}, {}, 2,
     ["parallel.stage_layers=[1, 2]", "model.layers=4"]),
    ("2D micro-batch not a multiple of q", {"pipeline": 2, "tensor": 4, "tensor_mode": "2d"},
     {"global_batch": 9, "micro_batch": 3}, 8, ["micro_batch", "q=2"]),
]


@pytest.mark.parametrize("name,parallel,train,world,words", BAD, ids=[b[0] for b in BAD])
def test_bad_pipeline_layout_is_refused_before_launch(name, parallel, train, world, words):
    raw = {**BASE, "parallel": {"data": 1, "tensor": 1, "tensor_mode": "none", **parallel},
           "train": {**BASE["train"], **train}}
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=world, cuda_available=False)
    msg = str(info.value)
    assert all(w in msg for w in words) and "Fix" in msg, msg


def test_default_split_is_even_and_gives_leftovers_to_the_middle():
    """Megatron's split: L/S decoder layers per stage (the embedding and the head ride on the end
    stages); when S does not divide L the leftover layers go to the middle stages, then one to
    the first. Explicit ``stage_layers`` stay as given."""
    from gridshard.job_layout import stage_layer_counts

    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]          # even (counting the ends as units gave 2, 3, 2, 1)
    assert stage_layer_counts(6, 4) == [1, 2, 2, 1]          # leftovers to the middle stages
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1]          # ... then one to the first
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]      # Llama 3 405B's published split
    assert stage_layer_counts(4, 4) == [1, 1, 1, 1]
    assert stage_layer_counts(5, 2, [1, 4]) == [1, 4]


def test_validation_loss_through_the_stages(references):
    """``val_loss`` with pipeline stages (the schedule's forward-only pass) equals the one-process
    run's at the same step."""
    def cfg(D, P, T, mode):
        c = _cfg(D, P, T, mode, steps=2, log_interval=1, eval_interval=1, eval_batches=2)
        c["data"] = {**c["data"], "val_fraction": 0.1}
        return c

    ref = run_on_ranks(1, _val_body, cfg(1, 1, 1, "none"), timeout=300)[0]
    got = run_on_ranks(4, _val_body, cfg(1, 2, 2, "1d"), timeout=300)[0]
    assert len(ref) == len(got) == 2 and all(v is not None for v in got)
    assert max(abs(a - b) / b for a, b in zip(got, ref)) < 1e-5


def _val_body(cfg):
    trainer = Trainer(cfg, progress=False)
    trainer.run()
    return [h.get("val_loss") for h in trainer.history]
