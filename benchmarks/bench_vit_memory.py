"""A ViT run's predicted peak memory per rank against the measured one (docs/vision.md, "Memory").

Trains a Vision Transformer on the bundled digits for a few steps in fresh worker processes and
prints, per rank, the trainer's ``predicted_mem_bytes`` beside ``peak_mem_bytes`` (on CPU the peak
resident set) and their ratio, with the prediction's parts of rank 0. Run it once as it is and
once with glibc's thresholds fixed, to separate what the allocator keeps resident from what the
model predicts:

    .venv/bin/python benchmarks/bench_vit_memory.py --nproc 1 --tensor 1 --mode none
    MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072 \\
        .venv/bin/python benchmarks/bench_vit_memory.py --nproc 4 --tensor 4 --mode 2d

Default shape: h 256, 4 layers, 4 heads, f 1024, 32×32 images in 4×4 patches (65 tokens),
micro-batch 64, fp32, 3 steps. Needs scikit-learn (``pip install -e .[vision]``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import run_on_fresh_ranks  # noqa: E402

MIB = 1 << 20


def _train(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    trainer.run()
    m = trainer.predicted_mem
    parts = {"baseline": m.baseline, "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
             "activations": m.activations, "buffers": m.comm_buffers, "transient": m.transient}
    return trainer.history[-1], parts


def vit_config(a) -> dict:
    return {"parallel": {"data": a.nproc // a.tensor, "tensor": a.tensor, "tensor_mode": a.mode},
            "model": {"kind": "vit", "image_size": a.image_size, "patch_size": 4, "channels": 1, "num_classes": 10,
                      "hidden": a.hidden, "layers": a.layers, "heads": 4, "ffn_hidden": 4 * a.hidden},
            "data": {"kind": "digits"},
            "train": {"global_batch": a.micro_batch * (a.nproc // a.tensor), "micro_batch": a.micro_batch,
                      "steps": a.steps, "log_interval": a.steps, "eval_interval": 0, "precision": a.precision,
                      "recompute": a.recompute}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--mode", default="none")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        out = run_on_fresh_ranks(a.nproc, _train, vit_config(a), run_dir, timeout=1800)
    last, parts = out[0]
    peaks, predicted = last["peak_mem_bytes_per_rank"], last["predicted_mem_bytes_per_rank"]
    print(f"{a.mode} T={a.tensor} on {a.nproc} rank(s), {a.precision}, recompute {a.recompute}; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')}")
    for r, (peak, pred) in enumerate(zip(peaks, predicted)):
        print(f"  rank {r}: predicted {pred / MIB:.1f} MiB, measured peak {peak / MIB:.1f} MiB, ratio {pred / peak:.3f}")
    print("  rank 0's prediction: " + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in parts.items()))


if __name__ == "__main__":
    main()
