"""Emulated ranks: rank r of an N-rank job, built and stepped in one process on this device.

``gridshard emulate CONFIG --gpus N --ranks first,last|all|R1,R2,...`` runs each chosen rank in
a fresh process of its own (spawned one after the other, so each peak is that rank's alone).
The process joins torch's *fake* process group (:func:`gridshard.torch_private.register_fake_backend`,
an in-process ``HashStore``: no socket) as rank r of N; every collective, DeviceMesh included,
returns at once without moving data. The job is then built exactly as rank r builds it
(:func:`gridshard.engine.job.build_job`: mesh coordinates, layers and shards, ZeRO units,
micro-batches) and ``--steps`` S real optimizer steps run on the local device
(:func:`gridshard.engine.step.train_step`).

What a fake collective returns is garbage, so nothing is allowed to branch on it: the steps
run without the non-finite checks (no ``skip_update``), the data are the run's own batches
(fixed shapes), and nothing is read back from a collective on the host (the run directory's
broadcast is skipped at world size N under the fake backend: :func:`gridshard.engine.job._frame`).

Per rank it reports, beside the trainer's own memory model and the planner's step for the
layout (:func:`gridshard.planner.evaluate`, ``--hardware``):

* ``peak_bytes``: CUDA ``max_memory_allocated``; CPU the process's peak resident set (the
  trainer's own ``peak_mem_bytes`` convention) with every freed block of 1 MiB or more handed back
  to the OS (:func:`gridshard.engine.memory_meter.unmap_large_frees`: the live bytes, as CUDA's
  figure), against ``predicted_peak_bytes``
  (:func:`gridshard.theory.memory.predict_rank_memory`, with this process's baseline);
* ``model_state_bytes``: parameters, gradients, optimizer state and ZeRO's own buffers as the
  rank holds them after its steps (:func:`gridshard.engine.memory_meter.model_state_tensor_bytes`,
  each storage once) against the model's params + grads + optimizer + comm buffers (ZeRO's flat
  reduction buffers; a pipeline's receive buffers are activations, not model state);
* ``compute_s``: the wall seconds of a whole step (every collective returns at once: what is
  left is compute, the host's work and the optimizer), the median over the steps after the first,
  with ``phases_s`` its named ranges (forward, backward per micro-batch at P = 1, the gradient
  reduction, the optimizer);
  against the planner's compute + optimizer + overhead seconds of the rank's busy time
  (``predicted_compute_s``: uncontended, as one rank alone on its slot; on a CPU the emulated rank
  gets the threads a launched rank would, the cores over the ranks per node);
* ``comm_bytes``: the ledger's payload bytes per step on each mesh axis: what the real rank's
  collectives would move.

What emulation cannot see: overlap of communication with compute, the time of the collectives
themselves, NCCL's own buffers, stragglers and the allocator's fragmentation across steps of a
long run. Pipeline stages vote on static or dynamic tensor metadata through the group at start-up;
under the fake group each stage answers its own vote with "static", what every gridshard stage
votes (:func:`gridshard.torch_private.answer_stage_votes`). Not yet emulated: expert parallelism
(an MoE layer's dispatch sizes come through a collective at E > 1).
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import statistics
import time
from typing import Optional

from ..errors import ConfigError


def chosen_ranks(spec: str, world: int) -> list:
    """``first,last`` | ``all`` | ``R1,R2,...`` as global ranks of a ``world``-rank job (sorted, each once)."""
    names = {"first": 0, "last": world - 1}
    if spec == "all":
        return list(range(world))
    out = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        value = names.get(part)
        if value is None:
            try:
                value = int(part)
            except ValueError:
                value = -1
        if not 0 <= value < world:
            raise ConfigError(f"--ranks {spec!r}: {part!r} is not a rank of the {world}-rank job. Fix: first, last, "
                              f"all, or ranks in 0..{world - 1} separated by commas.")
        out.add(value)
    return sorted(out)


def check_emulable(cfg) -> None:
    """Refuse what emulation cannot run yet (module docstring), before any process starts."""
    if getattr(cfg.model.resolve(), "experts", 0) and cfg.parallel.expert > 1:
        raise ConfigError(f"gridshard emulate: parallel.expert={cfg.parallel.expert}: with expert parallelism an MoE "
                          f"layer's dispatch sizes come through a collective, which the fake process group does not "
                          f"answer. Fix: emulate with parallel.expert=1 (the experts local to each rank), or run it.")


def emulate(cfg, world: int, ranks: list, steps: int = 3, hardware: str = "cpu", nodes: int = 1) -> list:
    """The report of each rank in ``ranks`` of ``cfg`` on ``world`` ranks (module docstring): one
    fresh spawned process per rank, one after the other."""
    from ..config import validate_config

    validate_config(cfg, world)
    check_emulable(cfg)
    if steps < 1:
        raise ConfigError(f"--steps {steps}: emulation needs at least one step. Fix: --steps 3.")
    config = cfg.model_dump(mode="json")
    spawn = multiprocessing.get_context("spawn")
    out = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn, max_tasks_per_child=1) as pool:
        for rank in ranks:
            out.append(pool.submit(emulate_rank, config, world, rank, steps, hardware, nodes).result())
    return out


def emulate_rank(config: dict, world: int, rank: int, steps: int, hardware: str = "cpu", nodes: int = 1) -> dict:
    """In this (fresh) process: join the fake group as ``rank`` of ``world``, build the job, run
    ``steps`` steps, and report (module docstring). On a CPU the rank gets the threads a launched
    rank would: the cores over the ranks per node (gridshard.launch)."""
    import os

    import torch
    import torch.distributed as dist

    from ..engine.memory_meter import model_state_tensor_bytes, process_peak_rss, unmap_large_frees
    from ..engine.step import train_step
    from ..engine.trainer import Trainer
    from ..torch_private import register_fake_backend

    register_fake_backend()
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world // max(1, nodes))))
        unmap_large_frees()                 # the resident peak follows the live tensors, not freed heap
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        trainer = Trainer(config, progress=False)
        job = trainer.job
        job.ranges.times = {}
        per_step, walls = [], []
        for k in range(steps):
            before, batch = dict(job.ranges.times), job.batch(k)
            start = time.perf_counter()
            train_step(job, batch)                         # no skip_update: nothing reads a fake result
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            walls.append(time.perf_counter() - start)
            per_step.append({n: s - before.get(n, 0.0) for n, s in job.ranges.times.items()})
        steady = per_step[1:] or per_step
        phases = {n: statistics.median(p.get(n, 0.0) for p in steady) for n in steady[0]}
        state = model_state_tensor_bytes(job.model, job.optimizer, job.reducer.memory_tensors())
        mem = trainer.predicted_mem
        peak = int(torch.cuda.max_memory_allocated(job.device)) if job.device.type == "cuda" else process_peak_rss()
        m = job.mesh
        return {"rank": rank, "world": world,
                "coords": {"data": m.data.rank, "pipeline": m.pipeline.rank, "context": m.context.rank,
                           "tensor": m.tensor.rank},
                "peak_bytes": peak, "predicted_peak_bytes": None if mem is None else int(mem.total),
                "model_state_bytes": int(state["params"] + state["grads"] + state["optimizer"] + state["extra"]),
                "predicted_model_state_bytes": None if mem is None else int(
                    mem.params + mem.grads + mem.optimizer + mem.comm_buffers - mem.details.get("stage_buffers", 0)),
                "compute_s": statistics.median(walls[1:] or walls), "phases_s": phases,
                "predicted_compute_s": _predicted_compute(trainer.cfg, world, nodes, hardware),
                "comm_bytes": {a: b / steps for a, b in sorted(job.ledger.by_axis().items()) if b}}
    finally:
        dist.destroy_process_group()


def _predicted_compute(cfg, world: int, nodes: int, hardware) -> Optional[float]:
    """The planner's busy compute + optimizer + overhead seconds of the layout's rank (its busy time,
    without the contention of other ranks on the node: what one emulated rank on its own slot
    measures), or None."""
    from . import evaluate, load_hardware
    from .fit import config_layout

    if cfg.model.unmodelled() is not None:
        return None
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    cand = evaluate(cfg, config_layout(cfg), hw, world, nodes=nodes, price_too_large=True)
    if not cand.rank_busy:
        return None
    busy = cand.rank_busy[min(cand.rank_busy)]
    return busy.compute_s + busy.optimizer_s + busy.overhead_s


def format_reports(reports: list) -> str:
    """The reports as a table, each measured figure beside its prediction and the ratio."""
    def ratio(a, b):
        return f"{a / b:5.2f}×" if a is not None and b else "    –"

    lines = ["rank coords(D,P,C,T)   peak MiB (pred, ratio)        model state MiB (pred, ratio)   "
             "compute s (pred, ratio)        comm bytes/step by axis"]
    for r in reports:
        c = r["coords"]
        pp, ps = r["predicted_peak_bytes"], r["predicted_model_state_bytes"]
        lines.append(
            f"{r['rank']:>4} ({c['data']},{c['pipeline']},{c['context']},{c['tensor']})"
            f"{'':<8}{r['peak_bytes'] / 2**20:8.1f} ({(pp or 0) / 2**20:8.1f}, {ratio(r['peak_bytes'], pp)})"
            f"   {r['model_state_bytes'] / 2**20:8.2f} ({(ps or 0) / 2**20:8.2f}, {ratio(r['model_state_bytes'], ps)})"
            f"   {r['compute_s']:7.4f} ({r['predicted_compute_s'] or 0:7.4f}, "
            f"{ratio(r['compute_s'], r['predicted_compute_s'])})   "
            + ", ".join(f"{a} {b:.0f}" for a, b in r["comm_bytes"].items()))
    return "\n".join(lines)


def emulated_plan(result, k: int, steps: int = 3) -> list:
    """``gridshard plan --emulate K``: the top ``k`` layouts of a :class:`~gridshard.planner.search.PlanResult`,
    each with its first and last rank emulated on this device, re-priced with the measured compute and
    peak, best first. The planner's compute + optimizer + overhead of the layout's ranks is replaced by
    the emulated step's seconds (the slowest emulated rank): on the critical path as measured; in the
    throughput regime of an over-subscribed node (this CPU) stretched by the node's contention, as
    the planner stretches its own (:func:`gridshard.planner.cost_time.node_step`). Communication keeps
    the planner's price (from the ledger's bytes, the same as the rank's: ``comm_bytes``). A layout
    whose emulated peak exceeds the device's memory is dropped, with the reason."""
    from ..config import load_config
    from .report import written_config

    hw, world = result.hardware, result.world
    rows = []
    for cand in result.candidates[:k]:
        cfg = load_config(written_config(result, cand.layout))
        reports = emulate(cfg, world, sorted({0, world - 1}), steps, hw, result.nodes)
        measured = max(r["compute_s"] for r in reports)
        peak = max(r["peak_bytes"] for r in reports)
        step = cand.step
        busy = [b.compute_s + b.optimizer_s + b.overhead_s for b in cand.rank_busy.values()]
        if step.details.get("regime") == "throughput":
            stretch = hw.contention(max(1, world // max(1, result.nodes)))
            emulated = step.total_s + stretch * (measured - sum(busy) / len(busy))
        else:
            emulated = step.total_s - (step.compute_s + step.optimizer_s + step.overhead_s) + measured
        reason = (f"emulated peak {peak / 2**30:.2f} GiB > {hw.device_memory_bytes / 2**30:.2f} GiB on {hw.name}"
                  if peak > hw.device_memory_bytes else "")
        rows.append({"layout": cand.layout.label(), "predicted_step_s": step.total_s, "emulated_step_s": emulated,
                     "predicted_compute_s": max(busy), "measured_compute_s": measured, "peak_bytes": peak,
                     "predicted_peak_bytes": cand.predicted_mem_bytes, "dropped": reason, "ranks": reports})
    return sorted(rows, key=lambda r: (bool(r["dropped"]), r["emulated_step_s"]))


def format_plan(rows: list) -> str:
    lines = ["re-ranked with emulated ranks (first and last rank of each layout, on this device):",
             "  #  layout                                 predicted s  emulated s   compute pred/meas   peak GiB"]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3}  {r['layout']:<38} {r['predicted_step_s']:11.4f} {r['emulated_step_s']:11.4f}   "
                     f"{r['predicted_compute_s']:8.4f}/{r['measured_compute_s']:<8.4f}  {r['peak_bytes'] / 2**30:8.2f}"
                     + (f"  dropped: {r['dropped']}" if r["dropped"] else ""))
    return "\n".join(lines)
