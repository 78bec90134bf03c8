"""Construction cost of a laid-out model: build a preset on the meta device, ``parallelize``
it at T = 1, 2, 4 (1D) and measure per rank

* ``cpu s``: process CPU time of building + materialising (the ranks share the machine's
  cores, so CPU time, not wall time, is the per-rank cost that falls with T);
* ``wall s``: wall time of the slowest rank;
* ``shard MiB``: this rank's parameter bytes (fp32);
* ``peak/shard``: (peak resident memory − resident memory just before building) / shard
  bytes — what the issue bounds by 1.3 (no rank ever holds a global tensor it does not own).

Each T runs in fresh processes (one gloo group, one thread per rank).

Run: ``.venv/bin/python benchmarks/bench_construction.py --preset 1.3b --tensor 1 2 4``
(``--preset tiny`` for a smoke run).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank, world, port, preset, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import gridshard
    from gridshard.models import Transformer
    from gridshard.models.presets import model_config

    mesh = gridshard.build_mesh(1, 1, world, "1d" if world > 1 else "none")
    cfg = model_config(preset)
    before = _rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = Transformer(cfg)
    model = gridshard.parallelize(model, mesh, seed=0, device="cpu")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    out_q.put((rank, wall, cpu, shard, peak - before))
    dist.barrier()
    dist.destroy_process_group()


def run(preset: str, world: int):
    from gridshard.netutil import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, preset, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [q.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    print(f"preset {args.preset}: build on meta + parallelize (1D), fresh processes per T")
    print(f"{'T':>3}{'cpu s (max rank)':>18}{'wall s':>9}{'shard MiB':>11}{'peak/shard (max)':>18}")
    for T in args.tensor:
        rows = run(args.preset, T)
        cpu = max(r[2] for r in rows)
        wall = max(r[1] for r in rows)
        shard = max(r[3] for r in rows)
        ratio = max(r[4] / r[3] for r in rows)
        print(f"{T:>3}{cpu:>18.1f}{wall:>9.1f}{shard / 2**20:>11.0f}{ratio:>18.3f}", flush=True)


if __name__ == "__main__":
    main()
