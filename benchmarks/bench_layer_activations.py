"""Saved activation bytes of one decoder layer, measured, against the memory model and Korthikanti et al.

On T gloo ranks (1D + sequence parallelism), for fp32 and CPU bf16 autocast and each
``train.recompute`` level, every rank lays out gridshard's model with 1 and with 2 decoder layers
and counts the bytes autograd saves during one forward
(:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters excluded); the difference is
one layer's. Printed next to :func:`gridshard.theory.memory.layer_saved_bytes` (activations) +
:func:`gridshard.theory.memory.weight_copy_bytes` (autocast's weight copies, bf16 only), in bytes
and in units of s·b·h/t, next to the published per-layer figure (docs/memory.md quotes the table).

    .venv/bin/python benchmarks/bench_layer_activations.py [--tensor 4] [--batch 2] [--seq 64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import run_on_fresh_ranks  # noqa: E402

SHAPE = dict(vocab_size=1000, hidden=384, heads=8, kv_heads=8, ffn_hidden=1024)     # f = 8h/3, K = H
LEVELS = ("none", "selective", "full")


def _saved(T: int, precision: str, layers: int, batch: int, seq: int) -> dict:
    """On one rank: recompute level → bytes saved by one forward of a ``layers``-layer model."""
    from gridshard import build_mesh, parallelize
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models import ModelConfig, Transformer
    from gridshard.parallel.recompute import apply_recompute

    cfg = ModelConfig(layers=layers, max_seq_len=seq, **SHAPE)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2))
    out = {}
    for level in LEVELS:
        with torch.device("meta"):
            plain = Transformer(cfg)
        model = parallelize(plain, build_mesh(1, 1, T, "1d"), sequence_parallel=True, seed=0, device="cpu")
        apply_recompute(model, level)
        ctx = model.parallel_context
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
            ctx.model_loss(model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
        out[level] = meter.bytes
    return out


def main() -> None:
    from gridshard.models import ModelConfig
    from gridshard.theory import memory as M

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    T, b, s = args.tensor, args.batch, args.seq
    h, a = SHAPE["hidden"], SHAPE["heads"]
    cfg = ModelConfig(layers=1, max_seq_len=s, **SHAPE)
    unit = s * b * h / T
    published = {"none": f"34 + 5as/h = {34 + 5 * a * s / h:.1f}", "selective": "34", "full": "2"}
    print(f"h={h} a={a} K={SHAPE['kv_heads']} f={SHAPE['ffn_hidden']} b={b} s={s} T={T}, 1D + SP, "
          f"torch {torch.__version__}")
    print("| precision | recompute | measured per layer (B) | formula: activations + weight copies (B) "
          "| activations / (s·b·h/t) | Korthikanti (2-byte) |")
    print("|---|---|---|---|---|---|")
    for precision in ("bf16", "fp32"):
        one, two = (run_on_fresh_ranks(T, _saved, T, precision, n, b, s, timeout=600) for n in (1, 2))
        e = M.activation_element_bytes(precision)
        for level in LEVELS:
            per_rank = {t[level] - o[level] for o, t in zip(one, two)}
            act = M.layer_saved_bytes(cfg, "1d", T, True, b * s, level, e)
            copies = M.weight_copy_bytes(cfg, "1d", T, 1, False, level, e)
            measured = per_rank.pop() if len(per_rank) == 1 else sorted(per_rank)
            print(f"| {precision} | {level} | {measured} | {act} + {copies} = {act + copies} | {act / unit:.2f} "
                  f"| {published[level] if precision == 'bf16' else '—'} |")


if __name__ == "__main__":
    main()
