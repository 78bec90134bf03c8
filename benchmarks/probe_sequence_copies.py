"""Per-call cost of gridshard's sequence all-gather / reduce-scatter (``gridshard.comm.collectives``):
a batch-first block (the reorder path: gather on dim 0 + ``torch.cat`` on dim 1, or ``torch.stack``
of the dim-1 chunks before the reduce-scatter) against the same values stored sequence-first (the
copy-free path), same gloo call, same bytes. A = [8, 256, 1024] fp32 (8 MiB), one thread per rank.

    .venv/bin/python benchmarks/probe_sequence_copies.py 4 .      # T, repository root

Prints, per case, the CPU time of one call (``time.process_time``, all threads of the rank;
median of 11, mean over ranks) and its wall time (median of 11, max over ranks)."""
import os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def body(rank, n, port, q, root):
    sys.path.insert(0, root)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    import gridshard
    from gridshard.comm import collectives as C
    mesh = gridshard.build_mesh(tensor=n, tensor_mode="1d")
    ax = mesh.tensor
    b, s, h = 8, 256, 1024
    blk_bf = torch.randn(b, s // n, h)                                  # batch-first block
    blk_sf = blk_bf.transpose(0, 1).contiguous().transpose(0, 1)        # same values, sequence-first
    full_bf = torch.randn(b, s, h)
    full_sf = full_bf.transpose(0, 1).contiguous().transpose(0, 1)
    res = {}
    for name, fn in [("all_gather dim1 batch-first", lambda: C.all_gather(blk_bf, ax, 1)),
                     ("all_gather dim1 seq-first", lambda: C.all_gather(blk_sf, ax, 1)),
                     ("reduce_scatter dim1 batch-first", lambda: C.reduce_scatter(full_bf, ax, 1)),
                     ("reduce_scatter dim1 seq-first", lambda: C.reduce_scatter(full_sf, ax, 1))]:
        fn()
        cpu, wall = [], []
        for _ in range(11):
            dist.barrier(); c, w = time.process_time(), time.perf_counter(); fn()
            cpu.append(time.process_time() - c); wall.append(time.perf_counter() - w)
        res[name] = (sorted(cpu)[5] * 1e3, sorted(wall)[5] * 1e3)
    q.put((rank, res))
    dist.destroy_process_group()

if __name__ == "__main__":
    n, root = int(sys.argv[1]), sys.argv[2]
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=body, args=(r, n, 29000 + os.getpid() % 1000, q, root)) for r in range(n)]
    [p.start() for p in ps]
    out = dict(q.get() for _ in ps)
    [p.join() for p in ps]
    for k in out[0]:
        print(f"{k:<34} CPU ms (median of 11, mean over ranks) {sum(out[r][k][0] for r in range(n)) / n:6.2f}   "
              f"wall ms (max over ranks) {max(out[r][k][1] for r in range(n)):6.2f}")
