"""``gridshard plan --calibrate``: measure this machine and write a hardware profile.

The one part of the planner that starts processes. It spawns ``nproc`` local ranks
(``torch.multiprocessing``, one thread each, a gloo group — NCCL on GPUs: backend and device
by :mod:`gridshard.device`'s rule, see :func:`calibrate`) and measures:

* **GEMM rate** by size: square fp32 matmuls of n ∈ {32 … 512} (GPU: bf16, up to 8192) on
  rank 0 alone, then on every rank at once. ``gemm_efficiency`` is the alone rate over
  the best rate; ``compute_slots_per_node`` = nproc × (rate at once / rate alone), the
  number of ranks that compute at full speed together (2 cores → ≈ 2; one GPU per rank → nproc).
* **memory bandwidth**: a 64 MiB tensor copy (read + write bytes / time).
* **the real trainer** (``gridshard.engine.Trainer``, all ranks at once, the ``tiny`` preset,
  :func:`reference_runs`): pairs of trainers at 1 and 4 layers — plain (D = nproc) at 2 and
  at 16 sequences of 64 tokens per micro-batch, 1D at T = 2, 2D at T = 4 — and a two-stage
  pipeline (2 and 4 layers, 4 micro-batches), all taking turns step by step in the same
  processes. The terms the cost model cannot derive from the GEMM, copy and collective
  timings are fitted so that it gives these runs back (:func:`gridshard.planner.calibrate_reference.fit_to_reference_trainers`):
  the element-wise bandwidth, the per-layer and per-step overheads (operator dispatch,
  autograd, the optimizer loop, the trainer's own work), the work around each tensor
  collective per mode, and the pipeline schedule's work per stage send or receive.
* **collectives**: all_reduce, all_gather, reduce_scatter, broadcast over a pair of ranks
  and over all ranks, and a send/recv pair, payloads 4 KiB and 4 MiB (median of 9); per op
  a two-point fit of t = latency + W/bandwidth on ring wire bytes W
  (:func:`gridshard.comm.ledger.ring_wire_bytes`): latency from the small payload, bandwidth
  from the difference; the latency's growth from 2 to nproc ranks is ``latency_per_rank_s``.
  The same fit on the process CPU clock (every thread: gloo's own included) around the same
  calls gives ``cpu_latency_s`` / ``cpu_latency_per_rank_s`` / ``cpu_bandwidth``, what a call
  keeps a core busy (the over-subscribed regime of the cost model). The small payload is
  timed ``SMALL_REPEATS`` times: its median is a latency, noisy on a shared machine.
* **sync skew** (``sync_skew_s``): every rank runs K rounds of a 256³ GEMM, once alone and
  once followed by a 4 KiB broadcast each round inside its pair of ranks ((0, 1), (2, 3), …:
  a tensor or data group of 2 while every other rank computes too; alternating, median of
  repeats); (with − without)/K is what one synchronous call costs between compute phases,
  the pair's isolated broadcast latency off it is the skew — peers arriving late or
  descheduled, which the isolated collective timings above (the pair measured while the other
  ranks wait) cannot see.
* **baseline** (``reserved_bytes``): the peak resident set of rank 0 after the reference
  training runs above minus the memory model's modelled bytes for them
  (:func:`gridshard.theory.memory.predict_rank_memory`, as the trainer reports it) — the
  Python, torch, gloo, data and allocator floor a real step runs on; the host's memory /
  nproc is ``device_memory_bytes`` on CPU.

Every measurement is a median of repeats; on a shared machine they move with the load,
which is why the profile records the load average it saw.
"""
from __future__ import annotations

import json
import os
import statistics
import time

from .calibrate_reference import REFERENCE_WIDE_MICRO, fit_to_reference_trainers, trainer_reference

SIZES = (32, 64, 128, 256, 512)
PAYLOADS = (4 << 10, 4 << 20)
REPEATS = 9
SMALL_REPEATS = 41          # the small payload's calls are latency: more of them for a stable median
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def _median_wall_and_cpu(fn, repeats: int, sync=lambda: None) -> tuple:
    """(median wall seconds, median process CPU seconds — every thread of this process, gloo's
    included) of one call of ``fn``."""
    fn()
    sync()
    ts, cs = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return statistics.median(ts), statistics.median(cs)


def _gemm_rates(torch, device, dtype, sizes, repeats=5) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        reps = max(1, int(2e7 / (2 * n ** 3))) if device.type == "cpu" else 10
        t = _median_wall_and_cpu(lambda: [a @ b for _ in range(reps)], repeats, sync)[0]
        out[n] = 2.0 * n ** 3 * reps / t
    return out


def _collective_times(torch, dist, device, world, group=None, repeats=REPEATS) -> tuple:
    """Median (wall seconds, this rank's CPU seconds) per (op, payload) on ``group`` (None: all
    ranks), as two ``{op: [[payload, seconds], ...]}``; ranks outside it skip."""
    from ..comm.collectives import _all_gather_flat, _reduce_scatter_flat

    out = {op: [] for op in OPS}
    cpu = {op: [] for op in OPS}
    rank = dist.get_rank()
    members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    if rank not in members:
        return out, cpu
    world, src = len(members), members[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for nbytes in PAYLOADS:
        reps = max(repeats, SMALL_REPEATS) if nbytes == min(PAYLOADS) else repeats
        n = nbytes // 4
        x = torch.ones(n, device=device)
        chunk = torch.empty(n // world, device=device)
        gathered = torch.empty(n // world * world, device=device)
        calls = {                                    # the calls gridshard's collectives make
            "all_reduce": lambda: dist.all_reduce(x, group=group),
            "all_gather": lambda: _all_gather_flat(gathered, chunk, group=group),
            "reduce_scatter": lambda: _reduce_scatter_flat(chunk, x[:n // world * world], group=group),
            "broadcast": lambda: dist.broadcast(x, src, group=group),
        }
        for op, fn in calls.items():
            dist.barrier(group=group)
            try:
                wall, used = _median_wall_and_cpu(fn, reps, sync)
            except (RuntimeError, ValueError):
                wall = used = None
            out[op].append((nbytes, wall))
            cpu[op].append((nbytes, used))
        if world > 1 and group is None:
            def pingpong():
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)
                    dist.send(x, 0)
            dist.barrier()
            wall, used = _median_wall_and_cpu(pingpong, reps, sync)
            out["send"].append((nbytes, wall / 2))
            cpu["send"].append((nbytes, used / 2))
    return out, cpu


SKEW_ROUNDS = 30


def _sync_skew(torch, dist, device, world: int, repeats: int = 5) -> dict:
    """Seconds of K rounds of a GEMM alone and with a 4 KiB broadcast after each (module
    docstring), medians over alternating repeats; every rank takes part."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)
    x = torch.ones(1024, device=device)
    pairs = [dist.new_group([i, i + 1]) if world > 2 else None for i in range(0, world - 1, 2)]
    rank = dist.get_rank()
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    src = (rank // 2) * 2

    def rounds(with_call: bool):
        for _ in range(SKEW_ROUNDS):
            a @ b
            if with_call and (mine is not None or world == 2):
                dist.broadcast(x, src, group=mine)
        sync()
        dist.barrier()

    times = {False: [], True: []}
    for _ in range(repeats):
        for with_call in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            rounds(with_call)
            times[with_call].append(time.perf_counter() - t0)
    return {"rounds": SKEW_ROUNDS, "compute_s": statistics.median(times[False]),
            "with_sync_s": statistics.median(times[True])}


def _rank_main(rank, world, port, backend, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist


    from ..device import device_for_backend

    torch.set_num_threads(1)
    device = device_for_backend(backend, local_rank=rank)          # nccl: cuda:rank; gloo: the CPU
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    overheads, modelled, floor = trainer_reference(world)        # first: its plain pair's peak is the floor
    dist.barrier()
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = (256, 1024, 2048, 4096, 8192) if cuda else SIZES
    alone = _gemm_rates(torch, device, dtype, sizes) if rank == 0 else None
    dist.barrier()
    together = _gemm_rates(torch, device, dtype, sizes)
    pair = dist.new_group([0, 1]) if world > 2 else None
    comm, comm_cpu = _collective_times(torch, dist, device, world)
    comm_pair, comm_pair_cpu = _collective_times(torch, dist, device, world, group=pair) if pair is not None \
        else (comm, comm_cpu)
    skew = _sync_skew(torch, dist, device, world)
    dist.barrier()
    if rank == 0:
        big = torch.empty(16 << 20, device=device)
        dst = torch.empty_like(big)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        bw = 2 * big.numel() * 4 / _median_wall_and_cpu(lambda: dst.copy_(big), 5, sync)[0]
        result = {"alone": alone, "together": together, "comm": comm, "comm_pair": comm_pair,
                  "comm_cpu": comm_cpu, "comm_pair_cpu": comm_pair_cpu, "memory_bandwidth": bw,
                  "peak_after_reference": floor, "reference_model_bytes": modelled,
                  "overheads": overheads.pop("none"),
                  "overheads_tokens": {str(REFERENCE_WIDE_MICRO): overheads.pop(f"none_m{REFERENCE_WIDE_MICRO}")},
                  "overheads_pipeline": overheads.pop("pipeline", None),
                  "overheads_tensor": overheads, "sync": skew}
        with open(result_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _fit(points, world: int, op: str):
    """Two-point fit of t = latency + W/bandwidth from the smallest and largest payload
    (module docstring); None when a point is missing."""
    from ..comm.ledger import ring_wire_bytes

    pts = sorted((ring_wire_bytes(op, p, world), t) for p, t in points if t)
    if len(pts) < 2:
        return None
    (w0, t0), (w1, t1) = pts[0], pts[-1]
    bw = (w1 - w0) / (t1 - t0) if t1 > t0 else w1 / t1
    latency = max(t0 - w0 / bw, 1e-7)
    return {"bandwidth": bw, "latency_s": latency}


def _pair_and_all_fit(points_all, points_pair, nproc: int, op: str):
    """α–β of ``op`` from its all-rank and pair measurements: latency on 2 ranks (the pair's),
    its growth per extra rank, the smaller of the two bandwidths; the all-rank fit alone when
    there is no pair measurement; None without measurements."""
    if not points_all:
        return None
    fit_all = _fit(points_all, nproc if op != "send" else 2, op)
    fit_pair = _fit(points_pair or points_all, 2, op)
    if fit_all and fit_pair:
        grow = (fit_all["latency_s"] - fit_pair["latency_s"]) / (nproc - 2) if nproc > 2 and op != "send" else 0.0
        return {"bandwidth": min(fit_all["bandwidth"], fit_pair["bandwidth"]),
                "latency_s": fit_pair["latency_s"], "latency_per_rank_s": max(0.0, grow)}
    return fit_all


def profile_from_measurements(m: dict, nproc: int, cuda: bool, host_memory: int) -> dict:
    """The hardware JSON (hardware module docstring) from rank 0's measurements."""
    alone = {int(k): v for k, v in m["alone"].items()}
    together = {int(k): v for k, v in m["together"].items()}
    peak = max(alone.values())
    # ranks that compute at full speed together: nproc × (rate together / rate alone), the median
    # over the larger sizes; on CPU at most the cores (a noisy "alone" run cannot make it more)
    ratios = sorted(together[n] / alone[n] for n in sorted(alone)[len(alone) // 2:])
    cap = float(nproc) if cuda else float(min(nproc, os.cpu_count() or nproc))
    slots = min(cap, max(1.0, nproc * statistics.median(ratios)))
    gemm = [[2.0 * n ** 3, alone[n] / peak] for n in sorted(alone)]
    ops = {}
    for op, points in m["comm"].items():
        fit = _pair_and_all_fit(points, m.get("comm_pair", {}).get(op), nproc, op)
        if fit is None:
            continue
        ops[op] = fit
        cpu = _pair_and_all_fit(m.get("comm_cpu", {}).get(op), m.get("comm_pair_cpu", {}).get(op), nproc, op)
        if cpu is not None:              # LinkCost.cpu_seconds: the same α–β on the CPU clock
            ops[op].update(cpu_bandwidth=cpu["bandwidth"], cpu_latency_s=cpu["latency_s"],
                           cpu_latency_per_rank_s=cpu.get("latency_per_rank_s", 0.0))
    default = ops.get("all_reduce") or next(iter(ops.values()), {"bandwidth": 1e9, "latency_s": 1e-4})
    ops["default"] = default
    ov = {int(k): v for k, v in m["overheads"].items()}
    stretch = max(1.0, nproc / slots)
    lo, hi = min(ov), max(ov)
    layer = max(0.0, (ov[hi] - ov[lo]) / (hi - lo))      # first guesses: fit_to_reference_trainers refits
    step = max(0.0, ov[lo] - lo * layer) / stretch
    layer /= stretch
    sync = m.get("sync")
    skew = 0.0
    if sync and not cuda:                # GPUs: a device per rank, left 0 (hardware module docstring)
        lat = (ops.get("broadcast") or default)["latency_s"]          # the pair's
        skew = max(0.0, (sync["with_sync_s"] - sync["compute_s"]) / sync["rounds"] - lat)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    profile = {
        "name": f"calibrated-{'gpu' if cuda else 'cpu'}-{nproc}",
        "device_memory_bytes": int(host_memory),
        "peak_flops": {"fp32": peak, "bf16": peak, "fp16": peak},
        "gemm_efficiency": gemm, "memory_bandwidth": m["memory_bandwidth"],
        "devices_per_node": nproc if cuda else 1024, "compute_slots_per_node": nproc if cuda else slots,
        "reserved_bytes": int(m["peak_after_reference"] - m["reference_model_bytes"]), "margin_fraction": 0.10,
        "layer_overhead_s": layer, "step_overhead_s": step, "dp_overlap": 1.0 if cuda else 0.0,
        "sync_skew_s": skew,
        "links": {"intra": ops, "inter": ops},
        "sources": [f"gridshard plan --calibrate --nproc {nproc} on {os.uname().nodename} at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}, load average {load}"],
        "notes": "peak_flops: the best measured single-rank GEMM rate (efficiency 1.0 at that size); collectives "
                 "measured over all nproc ranks on one host (no inter-node link: inter = intra).",
        "raw": m,
    }
    fit_to_reference_trainers(profile, m, nproc)
    return profile


def calibrate(nproc: int = 4, out: str = "gridshard-profile.json", timeout_s: float = 900.0,
              backend: str = "auto") -> dict:
    """Run the measurements on ``nproc`` local ranks and write the profile to ``out``.

    ``backend``: ``parallel.backend`` (``auto | nccl | gloo``), decided by the rule every job uses
    (:mod:`gridshard.device`): auto is nccl on a CUDA host — one GPU per rank, so ``nproc`` more
    than the visible GPUs is refused before any process starts (ConfigError, exit 2) instead of
    quietly measuring the CPU — and gloo (the CPU) otherwise."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from ..device import check_ranks_per_node, resolve_backend
    from ..netutil import free_port

    backend = resolve_backend(backend)
    check_ranks_per_node(nproc, backend, "--nproc")
    cuda = backend == "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        ctx = mp.start_processes(_rank_main, args=(nproc, free_port(), backend, path), nprocs=nproc, join=False,
                                 start_method="spawn")
        deadline = time.time() + timeout_s
        while not ctx.join(timeout=max(1.0, deadline - time.time())):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"calibration did not finish in {timeout_s:.0f} s")
        with open(path) as f:
            m = json.load(f)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = torch.cuda.get_device_properties(0).total_memory if cuda else host // nproc
    profile = profile_from_measurements(m, nproc, cuda, mem)
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    return profile


__all__ = ["calibrate", "profile_from_measurements"]
