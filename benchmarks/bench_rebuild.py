"""Step time of ``train.recompute: selective`` with and without the rebuilt saved tensors.

One rank's forward + backward of the mid-size model (h 256, 4 layers, 4 heads, f 704, V 512,
micro-batch 2 × 128 tokens, T = 1: what each rank of (D,T,mode) = (4,1,none) computes; the
data-parallel reduction is the same either way and left out). Two copies of the same model in one
process take turns step by step, so machine noise hits both alike:

* *regions only*: the attention core and the MLP activation checkpointed (selective before the
  rebuild, :data:`gridshard.parallel.recompute.SELECTIVE_SWITCHES`);
* *with rebuild*: :func:`gridshard.parallel.recompute.apply_recompute` ``selective``, which also
  rebuilds the norm outputs and silu(g)·u in backward (:mod:`gridshard.nn.rebuild`).

Prints the median step time of each and their ratio (one thread, three warm-up rounds).

    .venv/bin/python benchmarks/bench_rebuild.py [--precision fp32|bf16] [--rounds 40]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from gridshard.models import ModelConfig, Transformer  # noqa: E402
from gridshard.parallel.recompute import SELECTIVE_SWITCHES, apply_recompute  # noqa: E402

WARMUP = 3


def _models():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden=256, layers=4, heads=4, ffn_hidden=704, max_seq_len=128)
    rebuilt = Transformer(cfg)
    regions = copy.deepcopy(rebuilt)
    apply_recompute(rebuilt, "selective")
    for module in regions.modules():
        for switch in SELECTIVE_SWITCHES:
            if callable(getattr(module, switch, None)):
                getattr(module, switch)()
    return {"regions only": regions, "with rebuild": rebuilt}


def _step(model, tokens, bf16: bool) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = _models()
    tokens = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(1))
    times = {name: [] for name in models}
    for i in range(args.rounds + WARMUP):
        order = list(models) if i % 2 else list(reversed(models))
        for name in order:
            dt = _step(models[name], tokens, args.precision == "bf16")
            if i >= WARMUP:
                times[name].append(dt)
    before, after = (statistics.median(times[n]) for n in models)
    print(f"{args.precision}, {args.rounds} rounds, torch {torch.__version__}: selective regions only "
          f"{before * 1e3:.1f} ms, with rebuild {after * 1e3:.1f} ms, ratio {after / before:.3f}")


if __name__ == "__main__":
    main()
