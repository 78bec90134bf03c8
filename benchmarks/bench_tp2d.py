"""2D tensor parallelism (SUMMA on a q×q grid) against one device and Megatron 1D at the
same device count T = q², on CPU/gloo, in one run, one table.

Blocks (global shapes; b = batch, s = sequence, h = hidden, f = SwiGLU width):

* ``mlp``: Linear h→4h, GELU, Linear 4h→h, with biases (2D: two Linear2D; 1D: column →
  row).
* ``prenorm_mlp``: x + Linear 4h→h(GELU(Linear h→4h(LayerNorm(x)))), with biases (2D:
  LayerNorm2D and two Linear2D; 1D: a replicated LayerNorm, column → row; 1D+SP: the
  LayerNorm on the sequence block, its weight and bias through ``copy_to_group``). The
  block of issue 12's 2D/1D figure. Not in the default ``--blocks``.
* ``transformer``: one decoder layer (``layers[0]``) of the plain Llama-style
  :class:`gridshard.models.Transformer`, fed ``rope_tables(s, head_dim)``: a 1-layer model
  built on the meta device and laid out by ``gridshard.parallelize`` on each row's mesh
  (``none``, ``1d`` ± sequence parallelism, ``2d``) with the same ``seed`` (counter-based
  init: the same global weights in every row). q|k|v and gate|up are computed in one
  product each (:mod:`gridshard.parallel.shared_input`).

Rows: single device; for each q: 1D at T = q² (without and with sequence parallelism),
2D with double-buffered async SUMMA broadcasts ("2d"), and 2D with blocking broadcasts
and reduces ("2d-blocking": ``Linear2D(overlap=False)``, ``parallelize(summa_overlap=False)``).
Each row runs in fresh processes (``benchmarks/_runner.py``), one thread per rank, both
blocks in the same processes.

Columns:

* ``step ms``: forward + backward (input grad and every parameter grad, fixed random
  output gradient, no optimizer; no ``GatheredVectors`` window is open, so the 2D layers'
  bias / norm vectors are gathered in every forward, once per step as in training with one
  micro-batch per step); each timed step starts after a barrier and lasts as
  long as its slowest rank; median over ``--iters`` (≥ 5) timed steps after ``--warmup``,
  then the median over ``--repeats`` runs of the row (fresh processes each, the order of
  the rows alternated between runs); ``spread`` is the range of the per-run medians.
* ``vs 1 dev``: step time / single-device step time (same run).
* ``vs best other``: step time / the fastest other row at the same device count (same run).
* ``comm MiB``: payload bytes per rank per step from the ledger (its convention);
  ``theory MiB``: :mod:`gridshard.tensor.tp2d.theory` / :mod:`gridshard.tensor.tp1d.theory`.
* ``wire MiB``: bytes one rank sends per step on bandwidth-optimal rings (the ledger's
  ``wire_bytes``: all-reduce 2(n−1)/n, the others (n−1)/n of the payload): the figure
  that sets the bandwidth time, and the fair 1D-vs-2D comparison.
* ``calls``: collective calls per rank per step (latency rounds).
* ``wait ms``: time spent inside collectives or waiting for async ones, from the ledger
  with timing on, on one extra step (not the timed ones).
* ``param MiB``: parameter bytes per rank; ``saved MiB``: bytes autograd saves for
  backward per rank (``saved_tensors_hooks``, distinct storages, parameters, buffers and
  the rope tables excluded).
* ``max rel err``: max |y − y_ref| / max |y_ref| over the output and the input gradient,
  assembled from all ranks, against the single-device row (same global weights and input).

After the table, the ratio 2d / 2d-blocking per block and q (the overlap gain).

Run: ``.venv/bin/python benchmarks/bench_tp2d.py`` (defaults b=12 s=72 h=576 heads=36
kv_heads=heads f=1584, q = 2 3), or ``--quick`` for a smoke run.
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
BLOCKS = ("mlp", "transformer", "prenorm_mlp")


# --------------------------------------------------------------------------------------
# Models per row
# --------------------------------------------------------------------------------------

def _cfg(args):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=72, hidden=args["hidden"], heads=args["heads"], kv_heads=args["kv_heads"],
                       ffn_hidden=args["ffn"], max_seq_len=args["seq"], layers=1, init_std=args["init_std"])


def _decoder_layer(args, mesh, sp=False, **kw):
    """``layers[0]`` of a 1-layer plain Transformer built on meta, laid out on ``mesh``."""
    import torch

    from gridshard import parallelize
    from gridshard.models import Transformer

    with torch.device("meta"):
        model = Transformer(_cfg(args))
    return parallelize(model, mesh, sequence_parallel=sp, seed=args["seed"], device="cpu", **kw).layers[0]


def _mlp(first, second):
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = first, second

        def forward(self, x):
            return self.fc2(nn.functional.gelu(self.fc1(x)))

    return MLP()


def _prenorm_mlp(norm, first, second, axis=None):
    """x + fc2(gelu(fc1(norm(x)))); ``axis``: 1D+SP, the norm's parameters are used through
    ``copy_to_group`` (their gradient is partial over the sequence blocks). A sequence-first
    input is normalised as its [s, b, h] view, keeping the layout (as gridshard's RMSNorm)."""
    import torch.nn.functional as F
    from torch import nn

    class PreNormMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc1, self.fc2 = norm, first, second

        def _norm(self, x):
            if axis is None:
                return self.norm(x)
            from gridshard.comm.dual_ops import copy_to_group

            w, b = copy_to_group(self.norm.weight, axis), copy_to_group(self.norm.bias, axis)
            seq_first = x.dim() == 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous()
            xin = x.transpose(0, 1) if seq_first else x
            y = F.layer_norm(xin, self.norm.normalized_shape, w, b, self.norm.eps)
            return y.transpose(0, 1) if seq_first else y

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self._norm(x))))

    return PreNormMLP()


def build(block, impl, q, args):
    """(model, mesh) of one row; every rank holds the same global weights (same seed)."""
    from gridshard import build_mesh
    from gridshard.testing.plain import plain_linear

    h, std = args["hidden"], args["init_std"]
    from torch import nn

    if impl == "single":
        if block == "mlp":
            return _mlp(plain_linear(h, 4 * h, True, std), plain_linear(4 * h, h, True, std)), None
        if block == "prenorm_mlp":
            return _prenorm_mlp(nn.LayerNorm(h), plain_linear(h, 4 * h, True, std),
                                plain_linear(4 * h, h, True, std)), None
        return _decoder_layer(args, build_mesh(tensor=1, tensor_mode="none")), None
    if impl.startswith("1d"):
        from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear

        sp = impl == "1d+sp"
        mesh = build_mesh(tensor=q * q, tensor_mode="1d")
        if block == "mlp":
            return _mlp(ColumnParallelLinear(h, 4 * h, mesh, bias=True, sequence_parallel=sp, init_std=std),
                        RowParallelLinear(4 * h, h, mesh, bias=True, sequence_parallel=sp, init_std=std)), mesh
        if block == "prenorm_mlp":
            return _prenorm_mlp(nn.LayerNorm(h),
                                ColumnParallelLinear(h, 4 * h, mesh, bias=True, sequence_parallel=sp, init_std=std),
                                RowParallelLinear(4 * h, h, mesh, bias=True, sequence_parallel=sp, init_std=std),
                                mesh.tensor if sp else None), mesh
        return _decoder_layer(args, mesh, sp), mesh
    from gridshard.tensor.tp2d.linear import Linear2D

    mesh = build_mesh(tensor=q * q, tensor_mode="2d")
    overlap = impl != "2d-blocking"       # double-buffered async SUMMA broadcasts, or blocking ones
    if block == "mlp":
        return _mlp(Linear2D(h, 4 * h, mesh, bias=True, init_std=std, overlap=overlap),
                    Linear2D(4 * h, h, mesh, bias=True, init_std=std, overlap=overlap)), mesh
    if block == "prenorm_mlp":
        from gridshard.tensor.tp2d.norm import LayerNorm2D

        return _prenorm_mlp(LayerNorm2D(h, mesh), Linear2D(h, 4 * h, mesh, bias=True, init_std=std, overlap=overlap),
                            Linear2D(4 * h, h, mesh, bias=True, init_std=std, overlap=overlap)), mesh
    return _decoder_layer(args, mesh, summa_overlap=overlap), mesh


def local_block(t, impl, mesh):
    """This rank's part of a global [b, s, h] activation in the row's residual layout."""
    if impl in ("single", "1d"):
        return t
    if impl == "1d+sp":
        return t.chunk(mesh.tensor.size, 1)[mesh.tensor.rank].contiguous()
    return t.chunk(mesh.q, 0)[mesh.grid_row].chunk(mesh.q, -1)[mesh.grid_col].contiguous()


def assemble(parts, impl, q):
    """Global [b, s, h] from the per-rank parts (index = rank = tensor rank)."""
    import torch

    if impl in ("single", "1d"):
        return parts[0]
    if impl == "1d+sp":
        return torch.cat(parts, 1)
    return torch.cat([torch.cat(parts[i * q:(i + 1) * q], -1) for i in range(q)], 0)


def saved_bytes(model, fn, exclude=()):
    """Bytes of distinct storages autograd saves inside ``fn`` (parameters, buffers and the
    tensors ``exclude`` excluded)."""
    import torch

    from gridshard.nn.saved import as_saved

    state = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) + list(exclude)}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            seen[s.data_ptr()] = s.nbytes()
        return as_saved(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def bench_row(impl, q, args) -> dict:
    """Both blocks of one row on one rank (run on fresh ranks; every rank seeded alike)."""
    import torch

    from gridshard import LEDGER
    out = {}
    for block in args["blocks"]:
        model, mesh = build(block, impl, q, args)
        b, s, h = args["batch"], args["seq"], args["hidden"]
        x_full, gy_full = torch.randn(b, s, h), torch.randn(b, s, h)
        x_loc, gy_loc = local_block(x_full, impl, mesh), local_block(gy_full, impl, mesh)
        extra = ()
        if block == "transformer":       # the decoder layer takes (x, cos, sin)
            from gridshard.models.rope import rope_tables

            extra = rope_tables(s, h // args["heads"], _cfg(args).rope_theta)

        def step():                      # no cache window: 2D vectors gathered in the forward, as in step 1
            model.zero_grad(set_to_none=True)
            x = x_loc.detach().requires_grad_(True)
            y = model(x, *extra)
            y.backward(gy_loc)
            return y, x.grad

        times = time_steps(step, args["warmup"], args["iters"])
        LEDGER.reset()
        LEDGER.timing = True
        y, gx = step()
        LEDGER.timing = False
        row = {"times": times, "comm": LEDGER.payload_bytes(), "wire": LEDGER.total("wire_bytes"),
               "calls": LEDGER.count(), "wait": LEDGER.seconds(),
               "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        model.zero_grad(set_to_none=True)
        row["saved"], _ = saved_bytes(model, lambda: model(x_loc.detach().requires_grad_(True), *extra), extra)
        if args["check"]:
            row["y"], row["gx"] = tensor_to_bytes(y), tensor_to_bytes(gx)
        out[block] = row
    return out


# --------------------------------------------------------------------------------------
# Theory
# --------------------------------------------------------------------------------------

def theory_bytes(block, impl, q, args):
    b, s, h, f = args["batch"], args["seq"], args["hidden"], args["ffn"]
    if impl == "single":
        return 0
    if impl.startswith("1d"):
        from gridshard.tensor.tp1d import theory as tp1d

        sp = impl == "1d+sp"
        if block == "mlp":
            return tp1d.column_row_comm(b, s, h, q * q, sp, row_bias=True).payload_bytes()
        if block == "prenorm_mlp":     # + the SP LayerNorm's weight and bias gradients, h·e each
            return tp1d.column_row_comm(b, s, h, q * q, sp, row_bias=True).payload_bytes() + (2 * h * 4 if sp else 0)
        return tp1d.block_comm(b, s, h, q * q, sp, heads=args["heads"], kv_heads=args["kv_heads"]).payload_bytes()
    from gridshard.tensor.tp2d import theory as tp2d

    if block in ("mlp", "prenorm_mlp"):
        vol = tp2d.combine(tp2d.linear2d_comm(b * s, h, 4 * h, q, bias=True),
                           tp2d.linear2d_comm(b * s, 4 * h, h, q, bias=True))
        if block == "prenorm_mlp":
            if not hasattr(tp2d, "layernorm2d_comm"):
                return float("nan")
            vol = tp2d.combine(vol, tp2d.layernorm2d_comm(b * s, h, q))
    else:
        vol = tp2d.block2d_comm(b, s, h, f, q, heads=args["heads"], kv_heads=args["kv_heads"])
    return tp2d.total(vol).payload_bytes()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

def _rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def variants(qs):
    out = [("single", 1)]
    for q in qs:
        out += [("1d", q), ("1d+sp", q), ("2d", q), ("2d-blocking", q)]
    return out


HEADERS = ["block", "impl", "T", "step ms", "spread", "vs 1 dev", "vs best other", "comm MiB", "theory MiB", "wire MiB", "calls", "wait ms",
           "param MiB", "saved MiB", "max rel err"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seq", type=int, default=72)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (grouped-query attention; default: heads)")
    p.add_argument("--ffn", type=int, default=1584)
    p.add_argument("--q", type=int, nargs="+", default=[2, 3], help="grid sides (T = q² for 1D and 2D)")
    p.add_argument("--blocks", nargs="+", choices=BLOCKS, default=["mlp", "transformer"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7, help="timed steps per row (≥ 5)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row, fresh processes each, order alternated")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="counter-RNG seed of the decoder layer's weights")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="smoke run: b=6 s=36 h=72 heads=36 f=144, iters=5, repeats=1")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.seq, a.hidden, a.heads, a.ffn, a.warmup, a.iters, a.repeats = 6, 36, 72, 36, 144, 1, 5, 1
    if a.kv_heads is None:
        a.kv_heads = a.heads
    if a.heads % a.kv_heads:
        sys.exit(f"error: kv_heads={a.kv_heads} must divide heads={a.heads} (grouped-query attention).")
    for q in a.q:
        T = q * q
        for name, n, d in (("batch", a.batch, q), ("hidden", a.hidden, T), ("heads", a.heads, T), ("ffn", a.ffn, T),
                           ("seq", a.seq, T)):
            if n % d:
                sys.exit(f"error: {name}={n} is not divisible by {d} (q={q}): 2D needs batch % q, hidden % q²; "
                         f"1D at T=q² needs hidden, heads, ffn and seq (SP) % T. Fix: choose sizes divisible "
                         f"for every --q.")
    args = dict(batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn,
                warmup=a.warmup, iters=a.iters, init_std=a.init_std, seed=a.seed, check=not a.no_check,
                blocks=a.blocks)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    import torch

    log(f"bench_tp2d: b={a.batch} s={a.seq} h={a.hidden} heads={a.heads} kv_heads={a.kv_heads} f={a.ffn} q={a.q} "
        f"warmup={a.warmup} "
        f"iters={a.iters}; torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, 1 thread/rank")
    t0 = time.perf_counter()
    runs = {v: [] for v in variants(a.q)}   # per row: one entry (per-rank results) per repeat
    for rep in range(a.repeats):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]   # alternate the order against drift
        for impl, q in order:
            t1 = time.perf_counter()
            per_rank = run_on_fresh_ranks(q * q, bench_row, impl, q, args, timeout=a.timeout)
            runs[(impl, q)].append(per_rank)
            log(f"  run {rep + 1}/{a.repeats} {impl:<12} T={q * q}: " + "  ".join(
                f"{blk} {median(step_times_of_job([r[blk]['times'] for r in per_rank])) * 1e3:.1f} ms"
                for blk in a.blocks) + f"  ({time.perf_counter() - t1:.0f} s with start-up)")
    results = {v: reps[-1] for v, reps in runs.items()}

    def step_ms(v, block):
        """Median over repeats of the per-run median job step time, and the range of the per-run medians."""
        meds = [median(step_times_of_job([r[block]["times"] for r in per_rank])) * 1e3 for per_rank in runs[v]]
        return median(meds), min(meds), max(meds)

    rows, ratios = [], []
    for block in a.blocks:
        step = {v: step_ms(v, block)[0] for v in results}
        spread = {v: step_ms(v, block)[1:] for v in results}
        ref = results[("single", 1)][0][block]
        for (impl, q), per_rank in results.items():
            r0 = per_rank[0][block]
            err = "—"
            if args["check"]:
                y = assemble([tensor_from_bytes(r[block]["y"]) for r in per_rank], impl, q)
                gx = assemble([tensor_from_bytes(r[block]["gx"]) for r in per_rank], impl, q)
                err = f"{max(_rel_err(y, tensor_from_bytes(ref['y'])), _rel_err(gx, tensor_from_bytes(ref['gx']))):.1e}"
            lo, hi = spread[(impl, q)]
            others = [step[v] for v in results if v[1] == q and v != (impl, q)] if impl != "single" else []
            rows.append([block, impl, q * q, f"{step[(impl, q)]:.1f}", f"{lo:.0f}–{hi:.0f}",
                         f"{step[(impl, q)] / step[('single', 1)]:.2f}",
                         f"{step[(impl, q)] / min(others):.2f}" if others else "—",
                         f"{max(r[block]['comm'] for r in per_rank) / MiB:.2f}",
                         f"{theory_bytes(block, impl, q, args) / MiB:.2f}",
                         f"{max(r[block]['wire'] for r in per_rank) / MiB:.2f}", r0["calls"],
                         f"{max(r[block]['wait'] for r in per_rank) * 1e3:.1f}",
                         f"{max(r[block]['param_bytes'] for r in per_rank) / MiB:.3f}",
                         f"{max(r[block]['saved'] for r in per_rank) / MiB:.3f}", err])
        for q in a.q:
            ratios.append(f"{block} q={q}: 2d / 2d-blocking step time = "
                          f"{step[('2d', q)] / step[('2d-blocking', q)]:.3f}")
    print(format_table(HEADERS, rows, title=f"2D vs 1D TP, fp32 CPU/gloo, b={a.batch} s={a.seq} h={a.hidden} "
                                             f"heads={a.heads} kv_heads={a.kv_heads} f={a.ffn}; fwd+bwd step, median of {a.iters} steps × {a.repeats} run(s)"))
    print()
    print("Overlap (double-buffered async SUMMA broadcasts) vs blocking broadcasts:")
    for line in ratios:
        print("  " + line)
    log(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
