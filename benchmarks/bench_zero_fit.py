"""A model that does not fit at ZeRO-0 trains at ZeRO-3 + full recompute on this machine.

Four gloo ranks (D = 4, T = 1) on one host share its memory. The model (h 1536, 12 layers,
f 4096, vocabulary 32000, untied: Ψ ≈ 438 M parameters) holds 16 bytes of fp32 model state
per parameter at ZeRO-0 on *every* rank — 4 × 7.0 GB = 28 GB, more than the 24 GB machine —
and 16/D bytes at ZeRO-3. The script prints the formula's per-rank model state for every
stage (:func:`gridshard.theory.memory.model_state_bytes`), the host's memory, then trains
``--steps`` steps at ZeRO-3 + ``recompute=full`` and prints each rank's measured peak
resident memory next to the trainer's prediction (``predicted_mem_bytes``, when the
memory model provides it) and the losses.

    .venv/bin/python benchmarks/bench_zero_fit.py [--steps 3]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _runner import format_table, run_on_fresh_ranks  # noqa: E402

MODEL = {"preset": None, "vocab_size": 32000, "hidden": 1536, "layers": 12, "heads": 12, "ffn_hidden": 4096,
         "max_seq_len": 128}
D = 4


def _config(steps):
    return {"model": MODEL, "data": {"kind": "stdlib", "seq_len": 64, "max_bytes": 1_000_000},
            "parallel": {"data": D, "tensor": 1, "tensor_mode": "none"},
            "train": {"global_batch": 4, "micro_batch": 1, "steps": steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1,
                      "log_interval": 1, "seed": 1, "zero": 3, "recompute": "full"}}


def _train(cfg):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, progress=False)
    shapes = [(tuple(p.shape), None if u.name == "root" else i)      # (local shape, unit) in unit order
              for i, u in enumerate(trainer.reducer.units) for p in u.params]
    losses = trainer.run()
    last = trainer.history[-1]
    return {"shapes": shapes, "losses": losses, "peak": last["peak_mem_bytes_per_rank"],
            "predicted": last.get("predicted_mem_bytes")}


def _host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def main(steps: int) -> None:
    from gridshard.theory.memory import model_state_bytes

    res = run_on_fresh_ranks(D, _train, _config(steps), timeout=3600)
    shapes = res[0]["shapes"]
    params = sum(__import__("math").prod(s) for s, _ in shapes)
    gib = 2**30
    rows = []
    for stage in range(4):
        per_rank = model_state_bytes(shapes, stage, D, 0).held
        rows.append([f"ZeRO-{stage}", f"{per_rank / gib:.2f}", f"{D * per_rank / gib:.1f}"])
    print(f"model: {params / 1e6:.0f} M parameters; host memory {_host_bytes() / gib:.1f} GiB; D = {D} ranks")
    print(format_table(["stage", "model state per rank (GiB)", f"all {D} ranks (GiB)"], rows))
    rows = [[r, f"{x['peak'][r] / gib:.2f}", "—" if x["predicted"] is None else f"{x['predicted'] / gib:.2f}"]
            for r, x in enumerate(res)]
    print(format_table(["rank", "measured peak RSS (GiB)", "predicted (GiB)"], rows))
    print("losses:", [round(v, 4) for v in res[0]["losses"]])


if __name__ == "__main__":
    # glibc's malloc otherwise keeps freed multi-MB blocks (ZeRO-3's released layers) in its heap
    # instead of returning them to the system; a fixed mmap threshold makes a free a munmap
    # (docs/memory.md "Resident memory on CPU": it costs step time, so gridshard does not set it)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    main(ap.parse_args().steps)
