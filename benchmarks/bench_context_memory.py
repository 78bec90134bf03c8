"""Activation bytes per rank with the sequence split over C context ranks: measured and predicted.

On 4 gloo ranks, a tiny-width model (hidden 64, 8 heads of 8, 2 layers) reads one sequence of
``--seq`` tokens per rank position: at C = 1 every rank holds a whole sequence (D = 4, one
sequence each), at C = 4 the four ranks share one sequence (2c = S/4 tokens each; ring and
all-to-all). Each rank measures, around one forward, loss and backward of its tokens:

* **saved**: the bytes autograd keeps for backward at the end of the forward
  (:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters excluded);
* **peak**: the *peak activation bytes*, the largest sum of tensor bytes allocated inside the
  forward and backward and alive at one instant — saved activations, transient workspaces (score
  matrices, ring buffers, all-to-all copies, logits and their gradient) and gradients
  (:class:`gridshard.testing.live_bytes.LiveBytesMeter`; parameters and inputs are not counted);
* **predicted**: the memory model's activation and transient bytes of such a rank —
  :func:`gridshard.theory.memory.predict_rank_memory` with no parameters (``blocks=[]``):
  ``activations`` (saved bytes + logits workspace) + ``transient`` (at C > 1 the attention's
  backward buffers, :func:`gridshard.theory.context.context_transient_bytes`); the prediction of
  *saved* is :func:`gridshard.theory.memory.activation_bytes` ``.total``.

Printed per rank (max over ranks) with the ratio to C = 1 and the prediction's error.

    .venv/bin/python benchmarks/bench_context_memory.py [--seq 16384] [--layers 2]

k/v heads = query heads here, as in the run this table was first made with (the kernels take
grouped-query heads too).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import format_table, run_on_fresh_ranks  # noqa: E402

SHAPE = dict(vocab_size=256, hidden=64, heads=8, kv_heads=8, ffn_hidden=176)


def _measure(context: int, mode: str, seq: int, layers: int) -> tuple:
    """On one of 4 ranks: (saved bytes, peak live bytes) of one forward + loss + backward."""
    import torch.distributed as dist

    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models import ModelConfig, Transformer
    from gridshard.testing.live_bytes import LiveBytesMeter

    cfg = ModelConfig(layers=layers, max_seq_len=seq, **SHAPE)
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (1, seq), generator=g) for _ in range(2))
    with torch.device("meta"):
        plain = Transformer(cfg)
    mesh = build_mesh(world // context, 1, 1, "none", context=context)
    model = parallelize(plain, mesh, seed=0, device="cpu", context_mode=mode)
    ctx = model.parallel_context
    tok, tgt = ctx.shard_tokens(tokens), ctx.shard_tokens(targets)
    with LiveBytesMeter() as live:
        with SavedTensorMeter(exclude=model.parameters()) as saved:
            loss = ctx.model_loss(model, tok, tgt, reduction="sum")
        loss.backward()                                # every rank takes part in the ring's backward
        del loss
    return saved.bytes, live.peak


def predicted(context: int, mode: str, seq: int, layers: int) -> tuple:
    """(saved, peak) bytes the memory model predicts for one rank (module docstring)."""
    from gridshard.models import ModelConfig
    from gridshard.theory.memory import activation_bytes, predict_rank_memory

    cfg = ModelConfig(layers=layers, max_seq_len=seq, **SHAPE)
    mem = predict_rank_memory(cfg, seq_len=seq, micro_batch=1, blocks=[], context=context, context_mode=mode)
    return activation_bytes(cfg, 1, seq, context=context).total, mem.activations + mem.transient


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    rows, base = [], None
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    for C, mode in ((1, "ring"), (4, "ring"), (4, "all_to_all")):
        per_rank = run_on_fresh_ranks(4, _measure, C, mode, args.seq, args.layers, timeout=1800)
        saved, peak = max(s for s, _ in per_rank), max(p for _, p in per_rank)
        base = peak if C == 1 else base
        p_saved, p_peak = predicted(C, mode, args.seq, args.layers)
        rows.append([str(C), mode if C > 1 else "-", f"{args.seq // C}", mib(saved), mib(p_saved), mib(peak),
                     mib(p_peak), f"{p_peak / peak - 1:+.1%}", f"{peak / base:.3f}"])
    print(f"activation bytes per rank, one forward + loss + backward, S = {args.seq}, {args.layers} layers, "
          f"hidden {SHAPE['hidden']}, 4 gloo ranks, fp32")
    print(format_table(["C", "mode", "tokens/rank", "saved MiB", "predicted", "peak MiB", "predicted",
                        "error", "peak vs C=1"], rows))


if __name__ == "__main__":
    main()
