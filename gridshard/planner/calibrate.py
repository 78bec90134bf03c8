"""``gridshard plan --calibrate``: measure this machine and write a hardware profile.

The one part of the planner that starts processes. It spawns ``nproc`` local ranks
(``torch.multiprocessing``, one thread each, a gloo group — NCCL on GPUs) and measures:

* **GEMM rate** by size: square fp32 matmuls of n ∈ {32 … 512} (GPU: bf16, up to 8192) on
  rank 0 alone, then on every rank at once. ``gemm_efficiency`` is the alone rate over
  the best rate; ``compute_slots_per_node`` = nproc × (rate at once / rate alone), the
  number of ranks that compute at full speed together (2 cores → ≈ 2; one GPU per rank → nproc).
* **memory bandwidth**: a 64 MiB tensor copy (read + write bytes / time).
* **per-layer and per-step overheads**: the real trainer (``gridshard.engine.Trainer``, D =
  nproc, all ranks at once) on the ``tiny`` preset at one and at three layers; half the
  difference is the per-layer cost, the rest of the one-layer step the per-step cost, both
  divided by the measured contention (nproc / compute slots) so that the planner's
  contention factor gives them back at nproc ranks. Their GEMMs are negligible at this size:
  the figures are operator dispatch, autograd, the optimizer loop and the trainer's own
  per-step work.
* **collectives**: all_reduce, all_gather, reduce_scatter, broadcast over a pair of ranks
  and over all ranks, and a send/recv pair, payloads 4 KiB and 4 MiB (median of 9); per op
  a two-point fit of t = latency + W/bandwidth on ring wire bytes W
  (:func:`gridshard.comm.ledger.ring_wire_bytes`): latency from the small payload, bandwidth
  from the difference; the latency's growth from 2 to nproc ranks is ``latency_per_rank_s``.
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

SIZES = (32, 64, 128, 256, 512)
PAYLOADS = (4 << 10, 4 << 20)
REPEATS = 9
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def _median_time(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _gemm_rates(torch, device, dtype, sizes, repeats=5) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        reps = max(1, int(2e7 / (2 * n ** 3))) if device.type == "cpu" else 10
        t = _median_time(lambda: [a @ b for _ in range(reps)], repeats, sync)
        out[n] = 2.0 * n ** 3 * reps / t
    return out


def _collective_times(torch, dist, device, world, group=None, repeats=REPEATS) -> dict:
    """Median seconds per (op, payload) on ``group`` (None: all ranks); ranks outside it skip."""
    from ..comm.collectives import _all_gather_flat, _reduce_scatter_flat

    out = {op: [] for op in OPS}
    rank = dist.get_rank()
    if group is not None:
        members = dist.get_process_group_ranks(group)
        if rank not in members:
            return out
        world = len(members)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = {"group": group} if group is not None else {}
    barrier = (lambda: dist.barrier(group=group)) if group is not None else dist.barrier
    for nbytes in PAYLOADS:
        n = nbytes // 4
        x = torch.ones(n, device=device)
        chunks = [torch.empty(n // world, device=device) for _ in range(world)]
        src = 0 if group is None else dist.get_process_group_ranks(group)[0]
        gathered = torch.empty(n // world * world, device=device)
        calls = {                                    # the calls gridshard's collectives make
            "all_reduce": lambda: dist.all_reduce(x, **g),
            "all_gather": lambda: _all_gather_flat(gathered, chunks[0], group=group),
            "reduce_scatter": lambda: _reduce_scatter_flat(chunks[0], x[:n // world * world], group=group),
            "broadcast": lambda: dist.broadcast(x, src, **g),
        }
        for op, fn in calls.items():
            barrier()
            try:
                out[op].append((nbytes, _median_time(fn, repeats, sync)))
            except (RuntimeError, ValueError):
                out[op].append((nbytes, None))
        if world > 1 and group is None:
            def pingpong():
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)
                    dist.send(x, 0)
            dist.barrier()
            out["send"].append((nbytes, _median_time(pingpong, repeats, sync) / 2))
    return out


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
    g = {"group": mine} if mine is not None else {}

    def rounds(with_call: bool):
        for _ in range(SKEW_ROUNDS):
            a @ b
            if with_call and (mine is not None or world == 2):
                dist.broadcast(x, src, **g)
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


    torch.set_num_threads(1)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    overheads, modelled = _trainer_reference(world)        # first: its peak is the floor
    floor = _peak_bytes(torch, device)
    dist.barrier()
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = (256, 1024, 2048, 4096, 8192) if cuda else SIZES
    alone = _gemm_rates(torch, device, dtype, sizes) if rank == 0 else None
    dist.barrier()
    together = _gemm_rates(torch, device, dtype, sizes)
    pair = dist.new_group([0, 1]) if world > 2 else None
    comm = _collective_times(torch, dist, device, world)
    comm_pair = _collective_times(torch, dist, device, world, group=pair) if pair is not None else comm
    skew = _sync_skew(torch, dist, device, world)
    dist.barrier()
    result = None
    if rank == 0:
        big = torch.empty(16 << 20, device=device)
        dst = torch.empty_like(big)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        bw = 2 * big.numel() * 4 / _median_time(lambda: dst.copy_(big), 5, sync)
        result = {"alone": alone, "together": together, "comm": comm, "comm_pair": comm_pair, "memory_bandwidth": bw,
                  "peak_after_reference": floor, "reference_model_bytes": modelled,
                  "overheads": overheads, "sync": skew}
        with open(result_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


REFERENCE_STEPS = 12


def _peak_bytes(torch, device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def alternating_step_times(trainers: list, steps: int, warmup: int = 2) -> list:
    """Seconds of each trainer's step k, the trainers taking turns step by step in the same
    processes (a barrier before and after each step, so every rank times the same step);
    steps < ``warmup`` are not timed. One list per trainer."""
    import torch.distributed as dist

    times = [[] for _ in trainers]
    for k in range(steps):
        for i, tr in enumerate(trainers):
            dist.barrier()
            t0 = time.perf_counter()
            tr.step(k)
            dist.barrier()
            if k >= warmup:
                times[i].append(time.perf_counter() - t0)
    return times


def _trainer_reference(world: int) -> tuple:
    """Step seconds of the real trainer (``gridshard.engine.Trainer``, D = world, the ``tiny``
    preset at 1 and 3 layers, micro-batch 2 × 64 tokens) on all ranks at once — both trainers
    in the same processes, taking turns step by step so that a change of machine load hits them
    alike; medians over the rounds — and the memory model's modelled bytes of both (for the floor)."""
    from ..engine import Trainer

    trainers = {}
    for layers in (1, 3):
        cfg = {"model": {"preset": "tiny", "layers": layers}, "parallel": {"data": world},
               "data": {"kind": "stdlib", "seq_len": 64, "max_bytes": 200_000},
               "train": {"global_batch": 2 * world, "micro_batch": 2, "steps": REFERENCE_STEPS, "warmup_steps": 1}}
        trainers[layers] = Trainer(cfg, progress=False)
    times = dict(zip(trainers, alternating_step_times(list(trainers.values()), REFERENCE_STEPS)))
    modelled = sum(tr.predicted_mem.modelled for tr in trainers.values() if tr.predicted_mem is not None)
    return {layers: statistics.median(ts) for layers, ts in times.items()}, int(modelled)


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
        fit_all = _fit(points, nproc if op != "send" else 2, op)
        fit_pair = _fit(m.get("comm_pair", {}).get(op) or points, 2, op)
        if fit_all and fit_pair:
            grow = (fit_all["latency_s"] - fit_pair["latency_s"]) / (nproc - 2) if nproc > 2 else 0.0
            ops[op] = {"bandwidth": min(fit_all["bandwidth"], fit_pair["bandwidth"]),
                       "latency_s": fit_pair["latency_s"], "latency_per_rank_s": max(0.0, grow)}
        elif fit_all:
            ops[op] = fit_all
    default = ops.get("all_reduce") or next(iter(ops.values()), {"bandwidth": 1e9, "latency_s": 1e-4})
    ops["default"] = default
    ov = {int(k): v for k, v in m["overheads"].items()}
    stretch = max(1.0, nproc / slots)
    layer = max(0.0, (ov[3] - ov[1]) / 2)
    step = max(0.0, ov[1] - layer) / stretch
    layer /= stretch
    sync = m.get("sync")
    skew = 0.0
    if sync and not cuda:                # GPUs: a device per rank, left 0 (hardware module docstring)
        lat = (ops.get("broadcast") or default)["latency_s"]          # the pair's
        skew = max(0.0, (sync["with_sync_s"] - sync["compute_s"]) / sync["rounds"] - lat)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
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


def calibrate(nproc: int = 4, out: str = "gridshard-profile.json", timeout_s: float = 900.0) -> dict:
    """Run the measurements on ``nproc`` local ranks and write the profile to ``out``."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from ..netutil import free_port

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    backend = "nccl" if cuda else "gloo"
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
