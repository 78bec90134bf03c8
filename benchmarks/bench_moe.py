"""Step time of the Mixture-of-Experts block against a dense SwiGLU MLP of equal active FLOPs, the
share of it that is routing and dispatch, and the grouped product against the per-expert loop.

First one process, one thread (what one rank computes at expert-parallel size E = 1). Shapes: h 256,
n experts of width f_e, k = 2, micro-batch 4 × 256 tokens; the dense MLP has width k·f_e, so a
token's matmul FLOPs are equal (the router's h·n per token aside). Rows take turns round by round,
so machine noise hits all alike:

* *dense MLP*: :class:`gridshard.models.llama.SwiGLUMLP`, forward + backward;
* *MoE block*: :class:`gridshard.moe.layer.MoEBlock`, forward + backward (dropless, aux loss on);
* *experts only*: the same experts on the rows already sorted, with the same counts: MoE minus
  this is the routing, sort, gather and combine (the *dispatch share*).

Then forward only (CPU has no grouped backward): ``torch.nn.functional.grouped_mm`` against the
per-expert ``F.linear`` loop of :func:`gridshard.moe.experts.grouped_linear`, fp32.

Then expert parallelism (``--expert 1 2 4``, n = 8): E gloo ranks, one thread each, every rank its
own 4 × 256 tokens, the MoE block with its experts split over the E ranks (both dispatchers)
against the dense MLP on the same tokens, taking turns; the *exchange share* is the time the
rank spends in the block's exchanges (the ledger's timed collectives on the expert axis) over the
block's time. On a 2-core machine E = 4 ranks share 2 cores: compare the ratios, not the times.

Last, expert tensor parallelism (``--tensor-split T``, n = 8): on T gloo ranks with the same rows,
the experts whole (what a tensor group runs: repeated on each rank) against each expert's width
split T ways with the all-reduces the split needs (forward output, backward input gradient).

    .venv/bin/python benchmarks/bench_moe.py [--experts 4 8] [--expert 1 2 4] [--tensor-split 2] [--rounds 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gridshard.models.llama import ModelConfig, SwiGLUMLP  # noqa: E402
from gridshard.moe.experts import grouped_linear  # noqa: E402
from gridshard.moe.layer import MoEBlock  # noqa: E402

H, K, BATCH, SEQ, FE = 256, 2, 4, 256, 352


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rows(n_experts: int) -> dict:
    torch.manual_seed(0)
    dense = SwiGLUMLP(ModelConfig(hidden=H, ffn_hidden=K * FE, heads=4))
    moe = MoEBlock(H, n_experts, K, FE, aux_coefficient=0.01)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(BATCH, SEQ, H, requires_grad=True)
    with torch.no_grad():
        routing = moe.gate(x.view(-1, H), SEQ)
    counts = torch.bincount(routing.experts.flatten(), minlength=n_experts).tolist()
    sorted_rows = x.detach().view(-1, H).repeat_interleave(K, 0)[:sum(counts)].requires_grad_()

    def step(fn):
        return lambda: fn().sum().backward()

    return {"dense MLP": step(lambda: dense(x)), "MoE block": step(lambda: moe(x)),
            "experts only": step(lambda: moe.experts(sorted_rows, counts))}


def _grouped_rows(n_experts: int) -> dict:
    torch.manual_seed(0)
    x, w = torch.randn(BATCH * SEQ * K, H), torch.randn(n_experts, FE, H)
    counts = [len(c) for c in torch.arange(x.shape[0]).tensor_split(n_experts)]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return {"per-expert loop": lambda: grouped_linear(x, w, counts),
            "grouped_mm": lambda: F.grouped_mm(x, w.transpose(1, 2), offs=offsets)}


def _race(rows: dict, rounds: int) -> dict:
    times = {name: [] for name in rows}
    for r in range(rounds + 3):
        for name, fn in rows.items():
            t = _timed(fn)
            if r >= 3:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def _expert_parallel_body(expert: int, kind: str, n_experts: int, rounds: int) -> dict:
    """On each of E ranks: medians (s) of the dense MLP and the split MoE block, forward + backward,
    and the block's median seconds in expert-axis collectives per call."""
    import torch.distributed as dist

    from gridshard.comm.ledger import CommLedger
    from gridshard.mesh import build_mesh

    ledger = CommLedger(timing=True)
    mesh = build_mesh(expert, ledger=ledger, expert=expert)
    torch.manual_seed(0)
    dense = SwiGLUMLP(ModelConfig(hidden=H, ffn_hidden=K * FE, heads=4))
    moe = MoEBlock(H, n_experts, K, FE, aux_coefficient=0.01)
    if expert > 1:
        moe.split_experts(mesh.expert, kind)
        moe.experts.to_empty(device="cpu")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(BATCH, SEQ, H, requires_grad=True)
    exchange = []

    def moe_step():
        before = ledger.seconds()
        moe(x).sum().backward()
        exchange.append(ledger.seconds() - before)

    t = _race({"dense MLP": lambda: dense(x).sum().backward(), "MoE block": moe_step}, rounds)
    return {**t, "exchange": statistics.median(exchange[3:])}


def _expert_parallel(sizes, rounds: int, n_experts: int = 8) -> None:
    from _runner import run_rank0

    for E in sizes:
        for kind in ("all_to_all", "all_gather") if E > 1 else ("all_to_all",):
            t = run_rank0(E, _expert_parallel_body, E, kind, n_experts, rounds, timeout=600)
            label = f"E={E}" + (f" {kind}" if E > 1 else "")
            print(f"{label}: dense MLP {1e3 * t['dense MLP']:.1f}, MoE block {1e3 * t['MoE block']:.1f} "
                  f"({t['MoE block'] / t['dense MLP']:.2f}x dense), exchange share "
                  f"{t['exchange'] / t['MoE block']:.0%} (rank 0, n={n_experts})", flush=True)


def _tensor_split_body(tensor: int, n_experts: int, rounds: int) -> dict:
    """On each of T tensor ranks holding the same sorted rows (the tensor group's micro-batch, as
    after :meth:`~gridshard.moe.layer.MoEBlock.tokens_over`'s gathers): medians (s) of the experts
    as gridshard runs them (whole, repeated on every tensor rank) and as expert tensor parallelism
    would (each expert's width split T ways, the input's gradient and the output all-reduced over
    the tensor group: Megatron's f and g around a column- then row-split MLP), forward + backward."""
    from gridshard.comm.dual_ops import copy_to_group, reduce_from_group
    from gridshard.mesh import build_mesh
    from gridshard.moe.experts import Experts

    mesh = build_mesh(tensor=tensor)
    torch.manual_seed(0)
    whole, split = Experts(n_experts, H, FE), Experts(n_experts, H, FE // tensor)
    for p in list(whole.parameters()) + list(split.parameters()):
        torch.nn.init.normal_(p, std=0.02)
    rows = BATCH * SEQ * K
    counts = [len(c) for c in torch.arange(rows).tensor_split(n_experts)]
    x = torch.randn(rows, H, requires_grad=True)
    return _race({"repeated": lambda: whole(x, counts).sum().backward(),
                  "split": lambda: reduce_from_group(split(copy_to_group(x, mesh.tensor), counts),
                                                     mesh.tensor).sum().backward()}, rounds)


def _tensor_split(tensor: int, rounds: int, n_experts: int = 8) -> None:
    from _runner import run_rank0

    t = run_rank0(tensor, _tensor_split_body, tensor, n_experts, rounds, timeout=600)
    print(f"T={tensor} experts (n={n_experts}, {BATCH * SEQ * K} rows): repeated {1e3 * t['repeated']:.1f}, "
          f"split with its two all-reduces {1e3 * t['split']:.1f} ({t['split'] / t['repeated']:.2f}x)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, nargs="*", default=[4, 8],
                   help="experts n of the one-process rows (none: skip)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--expert", type=int, nargs="*", default=[1, 2, 4], help="expert-parallel sizes (none: skip)")
    p.add_argument("--tensor-split", type=int, default=2, help="T of the expert tensor split measured (0: skip)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"h={H} k={K} f_e={FE} tokens={BATCH}x{SEQ}, one thread, medians of {args.rounds} rounds (ms)")
    for n in args.experts:
        t = _race(_rows(n), args.rounds)
        share = (t["MoE block"] - t["experts only"]) / t["MoE block"]
        print(f"n={n}: dense MLP {1e3 * t['dense MLP']:.1f}, MoE block {1e3 * t['MoE block']:.1f} "
              f"({t['MoE block'] / t['dense MLP']:.2f}x dense), experts only {1e3 * t['experts only']:.1f}; "
              f"dispatch share {share:.0%}")
        g = _race(_grouped_rows(n), args.rounds)
        print(f"n={n} forward: per-expert loop {1e3 * g['per-expert loop']:.2f}, grouped_mm "
              f"{1e3 * g['grouped_mm']:.2f} ({g['grouped_mm'] / g['per-expert loop']:.2f}x the loop)")
    _expert_parallel(args.expert, args.rounds)
    if args.tensor_split > 1:
        _tensor_split(args.tensor_split, args.rounds)


if __name__ == "__main__":
    main()
