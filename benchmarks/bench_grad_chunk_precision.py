"""Why the reduced gradient chunk is fp32 under bf16 training (docs/zero.md, "Bytes against the
ZeRO paper"): the error of a gradient summed over A micro-batches and D data ranks when the sum is
kept in bf16 (the paper's count: 2-byte gradients all the way to the optimizer) against keeping it in
fp32 (gridshard's chunk, Megatron's fp32 main gradient), both against the exact (fp64) sum.

The A·D gradients are real: a small Llama's bf16 weight gradients (bf16 parameters, as under
``train.precision: bf16`` storage) on A·D different micro-batches of Python's own source as bytes.
The bf16 sum adds them one at a time in bf16, micro-batch by micro-batch and then rank by rank, as
an accumulator and a ring reduction of bf16 chunks would; the fp32 sum does the same in fp32. The
figure is the relative Frobenius error over all parameters, ‖sum − exact‖ / ‖exact‖, and the share
of elements whose bf16 sum differs from the exact one by more than 1 %.

    .venv/bin/python benchmarks/bench_grad_chunk_precision.py [--micro-batches 8] [--ranks 8]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from gridshard.models import ModelConfig, Transformer  # noqa: E402


def _batches(n: int, b: int, s: int):
    """n micro-batches of b sequences of s + 1 bytes of the standard library's source."""
    import sysconfig

    folder = sysconfig.get_paths()["stdlib"]
    data = b"".join(open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
                    if f.endswith(".py"))[: n * b * (s + 1)]
    return torch.tensor(list(data), dtype=torch.long).view(n, b, s + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--ranks", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, hidden=128, layers=2, heads=4, ffn_hidden=352, max_seq_len=128)
    model = Transformer(cfg).to(torch.bfloat16)
    n = args.micro_batches * args.ranks
    grads = []
    for tokens in _batches(n, 4, 128):
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
    exact = torch.stack(grads).double().sum(0)
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        total = torch.zeros_like(grads[0], dtype=dtype)
        for rank in range(args.ranks):                       # each rank accumulates its A micro-batches
            acc = torch.zeros_like(grads[0], dtype=dtype)
            for a in range(args.micro_batches):
                acc += grads[rank * args.micro_batches + a].to(dtype)
            total += acc                                     # then the reduction adds the ranks' chunks
        err = (total.double() - exact)
        big = (err.abs() > 0.01 * exact.abs()) & (exact.abs() > 1e-12)
        out[name] = (err.norm() / exact.norm()).item(), big.double().mean().item()
    print(f"{sum(q.numel() for q in model.parameters()):,} parameters, A = {args.micro_batches} micro-batches × "
          f"D = {args.ranks} ranks of 4 × 128 tokens, bf16 gradients")
    for name, (rel, share) in out.items():
        print(f"sum kept in {name}: relative error {rel:.2e}, elements off by > 1 %: {share:.2%}")


if __name__ == "__main__":
    main()
