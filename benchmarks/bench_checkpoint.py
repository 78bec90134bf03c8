"""Checkpoint cost at 4 ranks: save and load time and bytes per rank, and what an
asynchronous save every 10 steps costs the training step.

For each model (``tiny``, and ``mid``: h 512, 8 layers, vocabulary 32000, ≈ 58 M
parameters, ≈ 0.7 GB of checkpoint with the AdamW moments) at (D, T) = (1, 4) 1D:

* save: ``stage`` is the time the training thread is blocked (copying this rank's blocks to
  CPU memory), ``total`` the time until the checkpoint is published (DCP write on the
  checkpoint group, manifest with sha256, rename, ``latest``); ``MB written`` per rank are
  its DCP files (after deduplication);
* load: a fresh model and optimizer read the checkpoint back (manifest verification with
  the hashing split over ranks, then DCP reads of this rank's blocks); ``MB read`` is the
  size of this rank's blocks;
* async cost: ``steps`` training steps with ``save_interval=10`` against the same steps
  with no checkpoint, alternated ``repeats`` times in the same processes; the cost is the
  median paired ratio − 1 of the total wall time of the steps (the end-of-run save is
  excluded: ``train.steps`` is one more than a multiple of 10 and the loop is timed only).

Every figure is the median over ``repeats``; timings are of this machine (2 shared cores,
/tmp on local disk) and noisy.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 3] [--models tiny,mid]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import format_table, run_on_fresh_ranks  # noqa: E402

MODELS = {
    "tiny": {"preset": "tiny"},
    "mid": {"preset": None, "vocab_size": 32000, "hidden": 512, "layers": 8, "heads": 8, "ffn_hidden": 1408,
            "max_seq_len": 128},
}


def _config(model, steps, save_interval):
    return {"model": model, "data": {"kind": "stdlib", "seq_len": 64, "max_bytes": 400_000},
            "parallel": {"data": 1, "tensor": 4, "tensor_mode": "1d"},
            "train": {"global_batch": 4, "micro_batch": 4, "steps": steps, "log_interval": 1000,
                      "save_interval": save_interval, "keep_checkpoints": 2}}


def _bench_rank(model, steps, repeats):
    import torch
    import torch.distributed as dist

    from gridshard.checkpoint.blocks import model_blocks, optimizer_blocks
    from gridshard.engine import Trainer

    rank = dist.get_rank()
    root = tempfile.mkdtemp(prefix="gs_bench_ckpt_") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, 0)
    root = box[0]
    out = {"stage": [], "save": [], "load": [], "ratio": []}
    try:
        for r in range(repeats):
            run_dir = os.path.join(root, f"r{r}")
            trainer = Trainer(_config(model, 2, 0), run_dir=run_dir, progress=False)
            trainer.step(0)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.save_checkpoint(1)
            t1 = time.perf_counter()
            trainer.checkpointer.wait()
            dist.barrier()
            t2 = time.perf_counter()
            out["stage"].append(t1 - t0)
            out["save"].append(t2 - t0)
            folder = os.path.join(run_dir, "checkpoints", "step_1")
            written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                          if f.startswith(f"__{rank}_"))
            trainer.checkpointer.close()
            fresh = Trainer(_config(model, 2, 0), progress=False)
            from gridshard.checkpoint import Checkpointer

            ck = Checkpointer(None)
            dist.barrier()
            t0 = time.perf_counter()
            ck.load(folder, fresh.model, fresh.optimizer)
            dist.barrier()
            out["load"].append(time.perf_counter() - t0)
            ck.close()
            blocks = {**model_blocks(fresh.model), **optimizer_blocks(fresh.model, fresh.optimizer)}
            read = sum(b.view.numel() * b.view.element_size() for b in blocks.values())
            # async cost: the same steps with and without a save every 10 steps
            times = {}
            for name, (rd, interval) in {"none": (None, 0), "async": (os.path.join(root, f"a{r}"), 10)}.items():
                tr = Trainer(_config(model, steps + 1, interval), run_dir=rd, progress=False)
                dist.barrier()
                t0 = time.perf_counter()
                for k in range(steps):
                    tr.step(k)
                    if interval and (k + 1) % interval == 0:
                        tr.save_checkpoint(k + 1)
                if tr.checkpointer is not None:
                    tr.checkpointer.wait()
                dist.barrier()
                times[name] = time.perf_counter() - t0
                if tr.checkpointer is not None:
                    tr.checkpointer.close()
            out["ratio"].append(times["async"] / times["none"])
            out["step_s"] = times["none"] / steps
            del trainer, fresh
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"written": written, "read": read, **out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="tiny,mid")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        res = run_on_fresh_ranks(4, _bench_rank, MODELS[name], args.steps, args.repeats, timeout=3600)
        med = statistics.median
        rows.append([name, f"{max(r['written'] for r in res) / 2**20:.1f} / {sum(r['written'] for r in res) / 2**20:.1f}",
                     f"{max(r['read'] for r in res) / 2**20:.1f}",
                     f"{med(res[0]['stage']) * 1e3:.0f}", f"{med(res[0]['save']) * 1e3:.0f}",
                     f"{med(res[0]['load']) * 1e3:.0f}", f"{res[0]['step_s'] * 1e3:.0f}",
                     f"{(med(res[0]['ratio']) - 1) * 100:+.1f}%"])
    print(format_table(["model", "MB written max/all ranks", "MB read /rank", "stage ms", "save ms (published)",
                        "load ms", "step ms", "async save @10 cost"], rows))


if __name__ == "__main__":
    main()
