"""Wall and CPU time of one attention layer and one decoder layer, forward + backward, with the
sequence on one rank (C = 1, causal SDPA) or split over C = 4 gloo ranks (ring or all-to-all).

One *measurement* runs a row on fresh ranks (``benchmarks/_runner.py``; 1 thread per rank): one
untimed warm-up, then ``--iters`` timed forward + backward passes, each after a barrier. Per pass:
the wall time of the slowest rank, and the CPU time (``time.process_time``: compute, copies and
gloo's threads) summed over the ranks — the work the job does, which on a machine shared with
other jobs is steadier than the wall time. Rows alternate (the order reverses every round) for
``--rounds`` rounds; printed: the medians over all rounds' passes and the ratios to C = 1.

Shapes: b = 1, H = 8 query heads over H_kv = 4 k/v heads of d = 16 (attention: q, k, v are
inputs; the decoder layer: gridshard's Llama with 1 layer, hidden 128, vocab 256, forward + loss
+ backward). ``--old PATH`` adds the ring row on another checkout's gridshard (e.g. a worktree of
the commit before the ring's block product moved to the fused kernel): before/after.

    .venv/bin/python benchmarks/bench_context_time.py [--seq 4096 16384] [--rounds 3] [--iters 2]
        [--what attention decoder] [--old /tmp/R_old]
    .venv/bin/python benchmarks/bench_context_time.py --peak [--seq 16384] [--old /tmp/R_old]

``--peak``: instead of times, how far one attention forward + backward lifts each rank's process
peak resident set (after a warm-up pass; VmHWM reset through ``/proc/self/clear_refs``, Linux).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import format_table, median, run_on_fresh_ranks  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 16


def _attention_step(C: int, mode: str, seq: int):
    """A callable running one forward + backward of the attention core on this rank's tokens."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gridshard.context import all_to_all_attention, ring_attention, shard_sequence
    from gridshard.mesh import Axis

    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, h, seq, HEAD_DIM, generator=g), C, dist.get_rank(), dim=2)
               .requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    if C == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    axis = Axis("context", C, dist.get_rank(), tuple(range(C)), dist.group.WORLD)
    fn = ring_attention if mode == "ring" else all_to_all_attention
    return lambda: fn(q, k, v, axis).sum().backward()


def _decoder_step(C: int, mode: str, seq: int):
    """A callable running forward + loss + backward of a 1-layer gridshard Llama on this rank's tokens."""
    import torch

    from gridshard import build_mesh, parallelize
    from gridshard.models import ModelConfig, Transformer

    cfg = ModelConfig(layers=1, max_seq_len=seq, vocab_size=256, hidden=HEADS * HEAD_DIM, heads=HEADS,
                      kv_heads=KV_HEADS, ffn_hidden=352)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (1, seq), generator=g) for _ in range(2))
    with torch.device("meta"):
        plain = Transformer(cfg)
    model = parallelize(plain, build_mesh(1, 1, 1, "none", context=C), seed=0, device="cpu",
                        context_mode=mode)
    ctx = model.parallel_context
    x, y = ctx.shard_tokens(tokens), ctx.shard_tokens(targets)
    return lambda: ctx.model_loss(model, x, y, reduction="sum").backward()


def _timed(what: str, C: int, mode: str, seq: int, iters: int) -> list:
    """On each rank: [(wall s, cpu s)] of ``iters`` passes after one warm-up."""
    import torch.distributed as dist

    step = (_attention_step if what == "attention" else _decoder_step)(C, mode, seq)
    step()
    out = []
    for _ in range(iters):
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        step()
        out.append((time.perf_counter() - w, time.process_time() - c))
    return out


def _peak_rise(C: int, mode: str, seq: int) -> int:
    """On each rank: how far one attention forward + backward (after a warm-up) lifts the process's
    peak resident set above its resident set before it (Linux: ``/proc/self/clear_refs`` resets
    VmHWM to the current RSS)."""
    from gridshard.engine.memory_meter import process_peak_rss, rss_now

    step = _attention_step(C, mode, seq)
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss_now()
    step()
    return process_peak_rss() - base


def _measure(row: tuple, what: str, seq: int, iters: int) -> list:
    """One measurement of ``row`` = (label, C, mode, checkout or None): [(job wall, job cpu)] per pass."""
    label, C, mode, checkout = row
    saved = list(sys.path)
    if checkout:
        sys.path.insert(0, os.path.abspath(checkout))       # the ranks import gridshard from there
    try:
        if what == "peak":
            return run_on_fresh_ranks(C, _peak_rise, C, mode, seq, timeout=3600)
        per_rank = run_on_fresh_ranks(C, _timed, what, C, mode, seq, iters, timeout=3600)
    finally:
        sys.path[:] = saved
    return [(max(r[i][0] for r in per_rank), sum(r[i][1] for r in per_rank)) for i in range(iters)]


def _table(rows: list, results: dict) -> list:
    base = results[rows[0][0]]
    bw, bc = median([p[0] for p in base]), median([p[1] for p in base])
    out = []
    for label, C, mode, _ in rows:
        w, c = median([p[0] for p in results[label]]), median([p[1] for p in results[label]])
        out.append([label, str(C), f"{w:.3f}", f"{w / bw:.2f}", f"{c:.3f}", f"{c / bc:.2f}"])
    return out


def _print_peaks(rows: list, seqs: list) -> None:
    for seq in seqs:
        table = []
        for row in rows:
            rise = max(_measure(row, "peak", seq, 0))
            table.append([row[0], str(row[1]), f"{seq // row[1]}", f"{rise / 2**20:.1f}"])
        print(f"\npeak RSS rise of one attention forward + backward, S = {seq}, H = {HEADS}, H_kv = {KV_HEADS}, "
              f"d = {HEAD_DIM} (max over ranks)")
        print(format_table(["row", "C", "tokens/rank", "MiB"], table), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--what", nargs="+", default=["attention", "decoder"], choices=["attention", "decoder"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--old", default=None, help="another checkout: adds its ring row (before/after)")
    ap.add_argument("--peak", action="store_true", help="instead of times: each row's rise of the process "
                    "peak RSS during one attention forward + backward (max over ranks)")
    ap.add_argument("--skip-c1", action="store_true", help="only the C = 4 rows (ratios to the first row)")
    args = ap.parse_args()
    rows = [("C=1 sdpa", 1, "ring", None), ("C=4 ring", 4, "ring", None), ("C=4 all_to_all", 4, "all_to_all", None)]
    if args.skip_c1:
        rows = rows[1:]
    if args.old:
        rows.append(("C=4 ring (old)", 4, "ring", args.old))
    if args.peak:
        return _print_peaks(rows, args.seq)
    for what in args.what:
        for seq in args.seq:
            results = {r[0]: [] for r in rows}
            for rnd in range(args.rounds):
                for row in (rows if rnd % 2 == 0 else rows[::-1]):
                    results[row[0]] += _measure(row, what, seq, args.iters)
            print(f"\n{what}, forward + backward, S = {seq}, b = 1, H = {HEADS}, H_kv = {KV_HEADS}, d = {HEAD_DIM}; "
                  f"medians of {args.rounds} rounds x {args.iters} passes; ratios to the first row", flush=True)
            print(format_table(["row", "C", "wall s", "wall ratio", "cpu s (sum of ranks)", "cpu ratio"],
                               _table(rows, results)), flush=True)


if __name__ == "__main__":
    main()
