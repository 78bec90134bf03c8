"""1D tensor parallelism: gridshard (Megatron column/row, ± sequence parallelism) against
PyTorch's own DTensor tensor parallelism, on CPU/gloo, in one run, one table.

Blocks (global shapes; b = batch, s = sequence, h = hidden, f = SwiGLU width):

* ``mlp``: Linear h→4h (column), GELU, Linear 4h→h (row), with biases.
  Forward+backward ≈ 3 · 2 · b·s·(h·4h + 4h·h) FLOPs.
* ``transformer``: one decoder layer (``layers[0]``) of the plain Llama-style
  :class:`gridshard.models.Transformer` (RMSNorm, q/k/v projections, RoPE, causal SDPA,
  o_proj, RMSNorm, gate/up, SiLU·up, down_proj), fed ``rope_tables(s, head_dim)``. Every
  row builds the 1-layer model on the meta device and materialises it with the same
  ``seed`` (counter-based init: the same global weights at every layout): the single row
  and DTensor's plain copy through ``gridshard.parallelize`` on a ``tensor_mode="none"``
  mesh, gridshard's rows through ``parallelize`` on the 1D mesh (± SP), whose shared-input
  hooks compute q|k|v and gate|up in one matmul after one input collective each
  (:mod:`gridshard.parallel.shared_input`). DTensor parallelises the same plain layer:
  q/k/v and gate/up colwise (whole heads, heads/T local heads), o/down rowwise.

Rows: single device (T=1); for each T: gridshard and DTensor, each without and with
sequence parallelism (SP). Every row runs in fresh processes (``benchmarks/_runner.py``),
one thread per rank.

Columns:

* ``step ms``: forward + backward of the block with a fixed random output gradient (input
  grad and every parameter grad computed, no optimizer). gridshard's SP rows get the input
  block and output gradient stored sequence-first, the layout its SP layers keep inside a
  model (:mod:`gridshard.comm.dual_ops`); DTensor's get them contiguous. Each timed step starts after a
  barrier; a step lasts as long as its slowest rank (max over ranks); the figure is the
  median over ``--iters`` timed steps after ``--warmup``, then the median over
  ``--repeats`` runs (each in fresh processes). The spread column shows the range of the
  per-run medians.
* ``vs DTensor``: step time / DTensor's step time at the same T and SP, same run.
* ``comm MiB``: collective payload bytes per rank per step with the ledger's convention
  (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the unscattered
  input). gridshard: :data:`gridshard.LEDGER`; DTensor: its functional collectives counted
  by a dispatch mode (``_runner.CollectiveCounter``) on one extra untimed step.
* ``theory MiB``: :mod:`gridshard.tensor.tp1d.theory`, when that module exists.
* ``param MiB``: parameter bytes held per rank.
* ``max rel err``: max |y − y_ref| / max |y_ref| over the block output and the input
  gradient, against the single-device row (same global weights and inputs): proves each
  row computes the same block.

Run: ``.venv/bin/python benchmarks/bench_tp1d.py`` (defaults h=1024, s=256, b=8, heads=16,
kv_heads=heads), or
``--quick`` for a smoke run of the same 18 rows at tiny shapes (1–5 min on 2 busy cores,
almost all of it process start-up).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks._runner import (format_table, median, run_on_fresh_ranks, step_times_of_job,  # noqa: E402
                                tensor_from_bytes, tensor_to_bytes, time_steps)

MiB = 2.0 ** 20


# --------------------------------------------------------------------------------------
# Plain PyTorch blocks (single device reference and what DTensor parallelises)
# --------------------------------------------------------------------------------------

def _linear(in_f, out_f, bias, std):
    """gridshard's init-contract linear, so every row holds the same global weights."""
    from gridshard.testing.plain import plain_linear

    return plain_linear(in_f, out_f, bias, std)


def _plain_mlp(h, width, std):
    from torch import nn

    class PlainMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = _linear(h, width, True, std)
            self.fc2 = _linear(width, h, True, std)

        def forward(self, x):
            return self.fc2(nn.functional.gelu(self.fc1(x)))

    return PlainMLP()


def _model_config(args):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=64, hidden=args["hidden"], heads=args["heads"], kv_heads=args["kv_heads"],
                       ffn_hidden=args["ffn"], max_seq_len=args["seq"], layers=1, init_std=args["init_std"])


def _decoder_layer(args, mesh, sp=False):
    """``layers[0]`` of a 1-layer plain Transformer built on meta and laid out on ``mesh`` by
    ``gridshard.parallelize`` (a ``none`` mesh: the plain layer with its global weights)."""
    import torch

    from gridshard import parallelize
    from gridshard.models import Transformer

    with torch.device("meta"):
        model = Transformer(_model_config(args))
    return parallelize(model, mesh, sequence_parallel=sp, seed=args["seed"], device="cpu").layers[0]


def _rope(args):
    from gridshard.models.rope import rope_tables

    cfg = _model_config(args)
    return rope_tables(args["seq"], cfg.head_dim, cfg.rope_theta)


# --------------------------------------------------------------------------------------
# The three implementations
# --------------------------------------------------------------------------------------

def _build_single(block, args):
    from gridshard import build_mesh

    if block == "mlp":
        return _plain_mlp(args["hidden"], 4 * args["hidden"], args["init_std"])
    return _decoder_layer(args, build_mesh(tensor=1, tensor_mode="none"))


def _build_gridshard(block, args, T, sp):
    from torch import nn

    from gridshard import build_mesh
    from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear

    mesh = build_mesh(tensor=T, tensor_mode="1d")
    if block == "mlp":
        h, std = args["hidden"], args["init_std"]

        class GridshardMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = ColumnParallelLinear(h, 4 * h, mesh, bias=True, sequence_parallel=sp, init_std=std)
                self.fc2 = RowParallelLinear(4 * h, h, mesh, bias=True, sequence_parallel=sp, init_std=std)

            def forward(self, x):
                return self.fc2(nn.functional.gelu(self.fc1(x)))

        return GridshardMLP()
    return _decoder_layer(args, mesh, sp)


def _build_dtensor(block, args, T, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("tensor",))
    if block == "mlp":
        model = _plain_mlp(args["hidden"], 4 * args["hidden"], args["init_std"])
        if sp:
            plan = {"fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        return parallelize_module(model, mesh["tensor"], plan)
    from gridshard import build_mesh

    # the plain layer with the global weights (every rank materialises all of it), then DTensor
    model = _decoder_layer(args, build_mesh(data=T, tensor=1, tensor_mode="none"))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel()}
    # attention's inputs are (x, cos, sin): the rope tables pass through untouched (None)
    in_layout = Shard(1) if sp else Replicate()
    plan.update({
        "self_attn": PrepareModuleInput(input_layouts=(in_layout, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "mlp": PrepareModuleInput(input_layouts=(in_layout,), desired_input_layouts=(Replicate(),)),
    })
    if sp:
        plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    else:
        # the PrepareModuleInput above wraps the layer input once per module so q/k/v (gate/up)
        # share one DTensor input and their partial input gradients are summed before ONE
        # all-reduce, as gridshard's shared-input product does; without it DTensor
        # all-reduces per linear.
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh["tensor"], plan)


def _dtensor_finish(model, y, gx):
    """End a DTensor step with every result complete, as gridshard's step ends:

    * gradients DTensor leaves as ``Partial`` (the replicated RMSNorm weights under SP: each
      rank saw only its sequence block) are reduced to the parameter's placement (an
      all-reduce of h elements each; gridshard does the same inside its RMSNorm backward);
    * results of collectives DTensor issued asynchronously (``AsyncCollectiveTensor``: the
      input gradient, the SP output) are waited for, so their communication is inside the
      timed step instead of leaking into the next step's barrier."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def wait(t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
        return local

    with torch.no_grad():
        for p in model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(g.device_mesh, p.placements)
            if p.grad is not None:
                wait(p.grad)
    return wait(y), wait(gx)


def _param_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _sequence_first_layout() -> bool:
    """Whether this gridshard keeps SP activations sequence-first (commits before it did not)."""
    import importlib

    return hasattr(importlib.import_module("gridshard.tensor.tp1d.linear"), "is_sequence_first")


def bench_variant(block: str, impl: str, T: int, sp: bool, args: dict) -> dict:
    """One row on one rank (run on T fresh ranks by the runner, which seeds every rank alike).

    Builds the model (same global weights everywhere), draws the global input x [b, s, h]
    and output gradient gy, keeps this rank's sequence block of both under SP, times
    forward+backward, then runs one counted step and returns its output and input grad."""
    import torch
    import torch.distributed as dist

    from gridshard import LEDGER

    if impl == "single":
        model = _build_single(block, args)
    elif impl == "gridshard":
        model = _build_gridshard(block, args, T, sp)
    else:
        model = _build_dtensor(block, args, T, sp)
    b, s, h = args["batch"], args["seq"], args["hidden"]
    x_full, gy_full = torch.randn(b, s, h), torch.randn(b, s, h)
    rank = dist.get_rank()
    x_loc = x_full.chunk(T, dim=1)[rank].contiguous() if sp else x_full
    gy_loc = gy_full.chunk(T, dim=1)[rank].contiguous() if sp else gy_full
    if sp and impl == "gridshard" and _sequence_first_layout():
        # gridshard stores SP activations sequence-first ([b, s/T, h] view of a contiguous
        # [s/T, b, h]), as its SP embedding and row layers hand them on inside a model
        x_loc, gy_loc = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (x_loc, gy_loc))

    finish = _dtensor_finish if impl == "dtensor" else (lambda model, y, gx: (y, gx))
    extra = () if block == "mlp" else _rope(args)      # the decoder layer takes (x, cos, sin)

    def step():
        model.zero_grad(set_to_none=True)
        x = x_loc.detach().requires_grad_(True)
        y = model(x, *extra)
        y.backward(gy_loc)
        return finish(model, y, x.grad)

    times = time_steps(step, args["warmup"], args["iters"])

    LEDGER.reset()
    counted = None
    if impl == "dtensor":
        from benchmarks._runner import CollectiveCounter

        counted = CollectiveCounter()
        with counted:
            y, gx = step()
        comm, counts = counted.total_payload, dict(counted.counts)
    else:
        y, gx = step()
        comm = LEDGER.payload_bytes()
        counts = {op: LEDGER.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
                  if LEDGER.count(op)}
    out = {"times": times, "comm": comm, "counts": counts, "param_bytes": _param_bytes(model)}
    if args["check"]:
        out["y"], out["gx"] = tensor_to_bytes(y), tensor_to_bytes(gx)
    return out


# --------------------------------------------------------------------------------------
# Theory (gridshard/tensor/tp1d/theory.py, when it exists)
# --------------------------------------------------------------------------------------

def theory_comm_bytes(block, args, T, sp):
    """Predicted payload bytes per rank per step for gridshard's block, or None when
    ``gridshard.tensor.tp1d.theory`` does not exist (yet)."""
    try:
        from gridshard.tensor.tp1d import theory as tp1d
    except ImportError:
        return None
    return _theory_from_module(tp1d, block, args, T, sp)


def _theory_from_module(tp1d, block, args, T, sp):
    b, s, h = args["batch"], args["seq"], args["hidden"]
    if block == "mlp":  # one column → row pair with biases
        return tp1d.column_row_comm(b, s, h, T, sp, row_bias=True).payload_bytes()
    return tp1d.block_comm(b, s, h, T, sp, heads=args["heads"], kv_heads=args["kv_heads"]).payload_bytes()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

def _variants(tps, have_gridshard):
    out = [("single", 1, False)]
    for T in tps:
        for sp in (False, True):
            if have_gridshard:
                out.append(("gridshard", T, sp))
            out.append(("dtensor", T, sp))
    return out


def _gridshard_1d_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None
               for m in ("gridshard.tensor.tp1d.linear", "gridshard.parallel"))


def _rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _assemble(results, key, T, sp):
    import torch

    if not sp:
        return tensor_from_bytes(results[0][key])
    return torch.cat([tensor_from_bytes(r[key]) for r in results], dim=1)


def run_block(block, args, tps, have_gridshard, repeats, log):
    variants = _variants(tps, have_gridshard)
    runs = {v: [] for v in variants}
    for rep in range(repeats):
        order = variants if rep % 2 == 0 else [variants[0]] + variants[:0:-1]
        for v in order:
            impl, T, sp = v
            t0 = time.perf_counter()
            results = run_on_fresh_ranks(T, bench_variant, block, impl, T, sp, args, timeout=args["timeout"])
            job = step_times_of_job([r["times"] for r in results])
            runs[v].append((median(job), results))
            log(f"  [{block}] run {rep + 1}/{repeats} {impl:<9} T={T} SP={'y' if sp else 'n'}: "
                f"median step {median(job) * 1e3:8.1f} ms  (steps {', '.join(f'{t * 1e3:.0f}' for t in job)}; "
                f"{time.perf_counter() - t0:.0f} s with start-up)")
    ref = runs[variants[0]][-1][1][0]
    ref_y = tensor_from_bytes(ref["y"]) if args["check"] else None
    ref_gx = tensor_from_bytes(ref["gx"]) if args["check"] else None
    rows = []
    step_ms = {v: median([m for m, _ in runs[v]]) * 1e3 for v in variants}
    for v in variants:
        impl, T, sp = v
        meds = [m * 1e3 for m, _ in runs[v]]
        results = runs[v][-1][1]
        comm = results[0]["comm"]
        assert all(r["comm"] == comm for r in results), f"{v}: ranks disagree on comm bytes"
        dt = step_ms.get(("dtensor", T, sp))
        ratio = "—" if impl == "single" or dt is None else f"{step_ms[v] / dt:.2f}"
        theory = theory_comm_bytes(block, args, T, sp) if impl == "gridshard" else None
        theory_s = "—" if impl != "gridshard" else ("n/a" if theory is None else f"{theory / MiB:.2f}")
        err = "—"
        if args["check"]:
            e = max(_rel_err(_assemble(results, "y", T, sp), ref_y), _rel_err(_assemble(results, "gx", T, sp), ref_gx))
            err = f"{e:.1e}"
        counts = ", ".join(f"{op.replace('_', '-')}×{n}" for op, n in sorted(results[0]["counts"].items())) or "none"
        rows.append([block, impl, T, "yes" if sp else "no", f"{step_ms[v]:.1f}",
                     f"{min(meds):.0f}–{max(meds):.0f}" if len(meds) > 1 else "—", ratio,
                     f"{comm / MiB:.2f}", theory_s, counts, f"{results[0]['param_bytes'] / MiB:.2f}", err])
    return rows


HEADERS = ["block", "impl", "T", "SP", "step ms", "spread", "vs DTensor", "comm MiB", "theory MiB",
           "collectives / step", "param MiB", "max rel err"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16, help="attention heads (transformer block)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="kv heads (grouped-query attention; default: heads; kv_heads %% T = 0 so DTensor's "
                        "colwise k/v keep whole heads)")
    p.add_argument("--ffn", type=int, default=2816, help="SwiGLU width f (transformer block; ≈ 8h/3)")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes T")
    p.add_argument("--blocks", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per row, each in fresh processes")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="counter-RNG seed of the decoder layer's weights")
    p.add_argument("--no-check", action="store_true", help="skip the output/input-grad comparison")
    p.add_argument("--no-gridshard", action="store_true", help="DTensor and single-device rows only")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per row before it is killed")
    p.add_argument("--quick", action="store_true", help="smoke run: h=128, s=32, b=2, heads=4, f=352")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.seq, a.batch, a.heads, a.ffn, a.warmup = 128, 32, 2, 4, 352, 1
    if a.kv_heads is None:
        a.kv_heads = a.heads
    return a


def main(argv=None):
    a = parse_args(argv)
    args = {"hidden": a.hidden, "seq": a.seq, "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
            "ffn": a.ffn, "warmup": a.warmup, "iters": a.iters, "init_std": a.init_std, "seed": a.seed,
            "check": not a.no_check, "timeout": a.timeout}
    if a.heads % a.kv_heads:
        sys.exit(f"error: kv_heads={a.kv_heads} must divide heads={a.heads} (grouped-query attention).")
    for T in a.tp:
        for name, n in (("hidden", a.hidden), ("4*hidden", 4 * a.hidden), ("heads", a.heads), ("kv_heads", a.kv_heads),
                        ("ffn", a.ffn), ("seq", a.seq)):
            if n % T:
                sys.exit(f"error: {name}={n} is not divisible by T={T}: 1D tensor parallelism splits it over T "
                         f"ranks (seq: under sequence parallelism). Fix: choose sizes divisible by every --tp.")
    have_gs = _gridshard_1d_available() and not a.no_gridshard
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    import torch

    log(f"bench_tp1d: b={a.batch} s={a.seq} h={a.hidden} heads={a.heads} kv_heads={a.kv_heads} f={a.ffn} T={a.tp} "
        f"warmup={a.warmup} iters={a.iters} repeats={a.repeats}; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, gloo, 1 thread/rank" + ("" if have_gs else "; gridshard 1D layers not found"))
    t0 = time.perf_counter()
    rows = []
    for block in a.blocks:
        rows += run_block(block, args, a.tp, have_gs, a.repeats, log)
    print(format_table(HEADERS, rows,
                       title=f"1D TP, fp32 CPU/gloo, b={a.batch} s={a.seq} h={a.hidden} heads={a.heads} "
                             f"kv_heads={a.kv_heads} f={a.ffn}; fwd+bwd step, median of {a.iters} steps × {a.repeats} run(s)"))
    log(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
