"""Activation bytes per rank with the sequence split over C context ranks, measured.

On 4 gloo ranks, a tiny-width model (hidden 64, 8 heads of 8, 2 layers) reads one sequence of
``--seq`` tokens per rank position: at C = 1 every rank holds a whole sequence (D = 4, one
sequence each), at C = 4 the four ranks share one sequence (2c = S/4 tokens each; ring and
all-to-all). Each rank counts the bytes autograd saves for backward during one forward and loss
(:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters excluded): the activation
memory that lives from the forward to the backward, logits for the loss included. Printed per
rank (max over ranks) with the ratio to C = 1.

    .venv/bin/python benchmarks/bench_context_memory.py [--seq 16384] [--layers 2]

k/v heads = query heads here: PyTorch's CPU flash-attention kernel (which saves only the
output and its log-sum-exp) is not used with grouped-query heads, and the C = 1 baseline would
then save the whole S × S attention matrix.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import format_table, run_on_fresh_ranks  # noqa: E402

SHAPE = dict(vocab_size=256, hidden=64, heads=8, kv_heads=8, ffn_hidden=176)


def _saved(context: int, mode: str, seq: int, layers: int) -> int:
    """On one of 4 ranks: bytes saved for backward by one forward + loss of this rank's tokens."""
    import torch.distributed as dist

    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models import ModelConfig, Transformer

    cfg = ModelConfig(layers=layers, max_seq_len=seq, **SHAPE)
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (1, seq), generator=g) for _ in range(2))
    with torch.device("meta"):
        plain = Transformer(cfg)
    mesh = build_mesh(world // context, 1, 1, "none", context=context)
    model = parallelize(plain, mesh, seed=0, device="cpu", context_mode=mode)
    ctx = model.parallel_context
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        loss = ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
    loss.backward()                                    # every rank takes part in the ring's backward
    return meter.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    rows, base = [], None
    for C, mode in ((1, "ring"), (4, "ring"), (4, "all_to_all")):
        per_rank = run_on_fresh_ranks(4, _saved, C, mode, args.seq, args.layers, timeout=1800)
        peak = max(per_rank)
        base = peak if C == 1 else base
        rows.append([str(C), mode if C > 1 else "-", f"{args.seq // C}", f"{peak / 2**20:.1f}",
                     f"{peak / base:.3f}"])
    print(f"saved activation bytes per rank, one forward + loss, S = {args.seq}, {args.layers} layers, "
          f"hidden {SHAPE['hidden']}, 4 gloo ranks")
    print(format_table(["C", "mode", "tokens/rank", "MiB/rank", "vs C=1"], rows))


if __name__ == "__main__":
    main()
