"""One decoder block at 1D, 2D, 2.5D and 3D on the same 8 ranks, side by side, against one device.

The block is gridshard's Llama decoder layer (RMSNorm, causal attention with RoPE and
grouped-query heads, SwiGLU MLP; :class:`gridshard.models.llama.DecoderLayer`), one global model
(counter-based initial values from ``--seed``), fed a global batch of b sequences of s tokens
X [b, s, h] and a fixed random output gradient G (loss Σ y·G). Modes, all on 8 gloo ranks:

======  ====================================  ===============================================
mode    layout                                how it is built
======  ====================================  ===============================================
1d      T = 8 (Megatron column/row)           ``gridshard.parallelize`` of a 1-layer Transformer
1d+sp   T = 8 with sequence parallelism       ``parallelize(sequence_parallel=True)``
2d      q = 2 grid, D = 2 data replicas       ``parallelize`` on ``build_mesh(data=2, tensor=4, "2d")``
2.5d    q = 2, d = 2 depth layers             ``parallelize`` on ``build_mesh(tensor=8, "2.5d", depth=2)``
3d      q = 2 cube                            ``parallelize`` on ``build_mesh(tensor=8, "3d")``
======  ====================================  ===============================================

and, on request (``--modes ... 3d-layers``), the 3D block built from the layer family directly
(below), a cross-check of ``parallelize``'s 3D layout: it must move, keep and compute the same.

2D and 2.5D replicate the weights (over the data replicas, over the depth layers), so their step
ends with the gradient sum a training step does: one all-reduce of the rank's gradients (one flat
buffer) over ``mesh.data_context`` (2 ranks each), recorded in the ledger like every collective.
1D and 3D hold each weight element once in the 8 ranks: no gradient sum. Every mode gets its
block of X and G in the layout the model's own previous layer would hand it (1D+SP: the sequence
block stored sequence-first, as the SP embedding writes it).

``3d-layers``: the plain ``DecoderLayer`` with its modules swapped for
the 3D layer family on a :class:`gridshard.tensor.tp3d.mesh.Mesh3D` — the norms (``RMSNorm3D``) and
q, k, v, gate, up (``Linear3D``) on the residual orientation, ``o_proj`` and ``down_proj`` on the
swapped one, so the residual stream keeps its layout; the attention core runs on the rank's heads
(column block j) of its whole sequences (batch block i·q + l) — what ``parallelize`` builds at 3D
(:func:`gridshard.tensor.tp3d.build.build_3d`), with q|k|v and gate|up each computed as one product
of the joined weight blocks from one gather of the input block
(:func:`gridshard.parallel.shared_input.install_shared_input`, as ``parallelize`` hooks them). Weights
are the reference model's, cut by each parameter's ``ShardSpec``.

Per mode and rank (the table prints the max over ranks):

* ``step ms``: forward + backward (+ the gradient sum) of one step; rounds interleave the modes
  (round r runs every mode once, the order rotated by r, each step after a barrier; the job's
  step time is the slowest rank's); median over ``--rounds`` rounds after one warm-up round,
  and the range. ``CPU ms``: the CPU time of the step summed over the 8 ranks (median), the work
  the step costs on a shared machine. The ``1 dev`` row runs on rank 0 alone, in the same
  rounds, while the other ranks wait at the next barrier.
* ``wire KiB``, ``calls``: ring bytes one rank sends per step and its collective calls, from the
  ledger; ``= theory``: the ledger's total wire bytes and calls equal the theory modules'
  (:func:`theory_volume`: :mod:`gridshard.tensor.tp1d.theory`, ``tp2d``, ``tp2p5d``, ``tp3d``).
* ``peak MiB``: the peak of the tensor bytes one step allocates and keeps alive
  (:class:`gridshard.testing.live_bytes.LiveBytesMeter`): activations, workspaces, collective
  buffers and gradients, above the parameters (and the inputs).
* ``saved KiB``: bytes autograd keeps for backward
  (:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters and RoPE tables excluded);
  ``/ 1 dev``: that over one device's for the same global batch; ``table``: the layout's
  prediction, 1/8 for every split layout here (1D+SP 1/T on the sequence parts, 2D 1/(D·q²) —
  1/q² of the replica's micro-batch —, 2.5D 1/(d·q²), 3D 1/q³); 1D without SP keeps the
  replicated norm and residual activations whole. ``model KiB``:
  :func:`gridshard.theory.memory.layer_saved_bytes` where the memory model covers the mode.
* ``param KiB``: parameter bytes per rank (= :func:`theory_param_bytes`, asserted in the test).
* ``max rel err``: the output, the input gradient and every parameter gradient against the
  single-device block on the same global weights and inputs: max |Δ| / max |reference|.

    .venv/bin/python benchmarks/bench_tp_block.py [--batch 8 --seq 128 --hidden 256 --heads 8 \\
        --kv-heads 4 --ffn 512 --rounds 10]    # --theory: the formulas' table only, no ranks
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks._runner import format_table, median, run_on_fresh_ranks, step_times_of_job  # noqa: E402

WORLD = 8
MODES = ("1d", "1d+sp", "2d", "2.5d", "3d")          # the default rows; "3d-layers" on request
LAYOUTS = {"1d": "T=8", "1d+sp": "T=8, SP", "2d": "q=2, D=2", "2.5d": "q=2, d=2", "3d": "q=2",
           "3d-layers": "q=2, layer level"}
Q, DATA_2D, DEPTH = 2, 2, 2
KiB, MiB = 1024.0, 2.0 ** 20


# --------------------------------------------------------------------------------------
# Shapes and theory (no processes)
# --------------------------------------------------------------------------------------

def model_config(a):
    from gridshard.models import ModelConfig

    return ModelConfig(vocab_size=64, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn_hidden=a.ffn,
                       max_seq_len=a.seq, layers=1)


def check_shape(a) -> None:
    """SystemExit naming the size, the rule and a fix when a mode cannot lay the shape out.
    The model's own rules (heads, kv heads, ffn, hidden per mode) are checked again, with
    their own errors, by ``parallelize`` and the 3D layers on the ranks."""
    rules = [("batch", a.batch, DATA_2D * Q, "2D: D·q data × grid-row blocks; 2.5D: d·q; 3D: q²"),
             ("seq", a.seq, WORLD, "1D+SP splits the sequence over T = 8"),
             ("hidden", a.hidden, WORLD, "1D splits it over T = 8; 3D norm vectors in q³ blocks"),
             ("heads", a.heads, WORLD, "1D gives every one of the 8 ranks whole heads"),
             ("ffn", a.ffn, WORLD, "1D splits the MLP over T = 8"),
             ("kv_heads", a.kv_heads, Q, "2D, 2.5D and 3D split the kv heads over q")]
    for name, value, div, why in rules:
        if value % div:
            sys.exit(f"error: --{name.replace('_', '-')}={value} is not a multiple of {div} ({why}). "
                     f"Fix: choose a multiple of {div}.")
    if a.heads % a.kv_heads or not (WORLD % a.kv_heads == 0 or a.kv_heads % WORLD == 0):
        sys.exit(f"error: --kv-heads={a.kv_heads} must divide --heads={a.heads} and divide or be a multiple of 8 "
                 f"(1D at T = 8 splits or replicates kv heads). Fix: e.g. --kv-heads 4 or 8.")


def block_param_elems(a) -> int:
    """Global parameters of one block: 2h² + 2·K·d·h + 3hf + 2h."""
    kd = a.kv_heads * (a.hidden // a.heads)
    return 2 * a.hidden * a.hidden + 2 * kd * a.hidden + 3 * a.hidden * a.ffn + 2 * a.hidden


def theory_volume(mode: str, a) -> tuple:
    """(ring wire bytes, calls) one rank of ``mode`` sends per step, from the theory modules:

    * 1d / 1d+sp: ``tp1d.block_comm`` on T = 8 (kv heads replicated when K < 8);
    * 2d: ``tp2d.block2d_comm`` on the replica's b/D sequences, + one all-reduce of the rank's
      parameter bytes ``tp2d.block2d_param_bytes`` over the D = 2 replicas;
    * 2.5d: one depth layer's 2D block on b/d sequences (``tp2p5d.lift``), + the depth sum: one
      all-reduce of the same parameter bytes over the d = 2 layers;
    * 3d: ``tp3d.block3d_comm``: two ``tp3d.rmsnorm3d_comm`` and four ``tp3d.linear3d_comm``: q|k|v
      h → h + 2·K·d and gate|up h → 2f (one product each, the input gathered once) on the residual
      orientation, o h → h and down f → h on the swapped one."""
    from gridshard.theory import CommVolume
    from gridshard.tensor.tp1d import theory as tp1d
    from gridshard.tensor.tp2d import theory as tp2d
    from gridshard.tensor.tp2p5d import theory as tp2p5d
    from gridshard.tensor.tp3d import theory as tp3d

    b, s, h, f, H, K = a.batch, a.seq, a.hidden, a.ffn, a.heads, a.kv_heads
    if mode in ("1d", "1d+sp"):
        v = tp1d.block_comm(b, s, h, WORLD, mode == "1d+sp", heads=H, kv_heads=K)
        return v.wire_bytes(), sum(v.calls.values())
    if mode in ("3d", "3d-layers"):
        vol = tp3d.block3d_comm(b, s, h, f, Q, heads=H, kv_heads=K)
        return tp3d.wire_bytes(vol), tp3d.rounds(vol)
    replicas = DATA_2D if mode == "2d" else DEPTH
    grads = CommVolume(replicas).add("all_reduce", tp2d.block2d_param_bytes(h, f, Q, heads=H, kv_heads=K))
    layer = tp2d.block2d_comm(b // replicas, s, h, f, Q, heads=H, kv_heads=K)
    if mode == "2.5d":
        layer = tp2p5d.lift(layer, Q, DEPTH)
    return tp2p5d.wire_bytes(layer) + grads.wire_bytes(), tp2p5d.rounds(layer) + sum(grads.calls.values())


def theory_param_bytes(mode: str, a) -> int:
    """Parameter bytes per rank: ``tp1d.block_param_bytes`` on T = 8 (norms replicated, kv heads
    replicated when K < 8), ``tp2d.block2d_param_bytes`` on the q = 2 grid (2D and 2.5D: 1/q²),
    1/q³ of the block at 3D."""
    from gridshard.tensor.tp1d import theory as tp1d
    from gridshard.tensor.tp2d import theory as tp2d

    if mode in ("1d", "1d+sp"):
        return tp1d.block_param_bytes(a.hidden, a.ffn, WORLD, heads=a.heads, kv_heads=a.kv_heads)
    if mode in ("3d", "3d-layers"):
        return block_param_elems(a) // Q ** 3 * 4
    return tp2d.block2d_param_bytes(a.hidden, a.ffn, Q, heads=a.heads, kv_heads=a.kv_heads)


def theory_table(a) -> str:
    """Per mode, from the formulas alone (no ranks): wire bytes and calls per rank per step,
    parameter bytes per rank, the memory model's saved bytes per rank."""
    cells = []
    for mode in a.modes:
        wire, calls = theory_volume(mode, a)
        saved = model_saved_bytes(mode, a)
        cells.append([mode, LAYOUTS[mode], f"{wire / MiB:.2f}", calls, f"{theory_param_bytes(mode, a) / MiB:.2f}",
                      "—" if saved is None else f"{saved / MiB:.2f}"])
    return format_table(["mode", "layout", "wire MiB", "calls", "param MiB", "saved MiB (model)"], cells)


def model_saved_bytes(mode: str, a):
    """The memory model's saved bytes per rank for one layer (None where it has no formula)."""
    from gridshard.job_layout import TensorMode
    from gridshard.theory.memory import layer_saved_bytes

    cfg, n = model_config(a), a.batch * a.seq
    try:
        if mode in ("1d", "1d+sp"):
            return layer_saved_bytes(cfg, "1d", WORLD, mode == "1d+sp", n)
        if mode == "2d":
            return layer_saved_bytes(cfg, "2d", Q * Q, False, n // DATA_2D)
        if mode == "2.5d":
            layer_mode, T = TensorMode.TWO_P5_D.layer_layout(WORLD, DEPTH)
            return layer_saved_bytes(cfg, str(layer_mode), T, False, n // DEPTH)
        return layer_saved_bytes(cfg, "3d", WORLD, False, n)      # 3d, 3d-layers
    except Exception:  # noqa: BLE001 - the memory model does not cover this mode (yet)
        return None


# --------------------------------------------------------------------------------------
# The blocks, on each rank
# --------------------------------------------------------------------------------------

def _copy_t(w):
    """Linear3D's ``weight_init``: the global [in, out] weight is the reference's [out, in] transposed."""
    return lambda full: full.copy_(w.t())


def build_3d_layer(ref_layer, cfg, mesh):
    """The plain DecoderLayer with ``ref_layer``'s weights, laid out on the 3D ``mesh`` (module
    docstring)."""
    from gridshard.job_layout import TensorMode
    from gridshard.models.llama import DecoderLayer
    from gridshard.parallel.shared_input import install_shared_input
    from gridshard.tensor.tp3d.linear import Linear3D
    from gridshard.tensor.tp3d.norm import RMSNorm3D

    refs = {n: p.detach() for n, p in ref_layer.named_parameters()}
    layer = DecoderLayer(cfg)

    def linear3d(parent, path, name, on):
        m = getattr(parent, name)
        return Linear3D(m.in_features, m.out_features, on, bias=False,
                        weight_init=_copy_t(refs[f"{path}.{name}.weight"]))

    attn, mlp, sw = layer.self_attn, layer.mlp, mesh.swapped()
    for parent, path, names in ((attn, "self_attn", ("q_proj", "k_proj", "v_proj")),
                                (mlp, "mlp", ("gate_proj", "up_proj"))):
        for n in names:                                                 # residual layout → swapped
            setattr(parent, n, linear3d(parent, path, n, mesh))
    attn.o_proj = linear3d(attn, "self_attn", "o_proj", sw)          # back to the residual layout
    mlp.down_proj = linear3d(mlp, "mlp", "down_proj", sw)
    layer.input_layernorm = RMSNorm3D(cfg.hidden, mesh, cfg.norm_eps)
    layer.post_attention_layernorm = RMSNorm3D(cfg.hidden, mesh, cfg.norm_eps)
    install_shared_input(attn, ("q_proj", "k_proj", "v_proj"), TensorMode.THREE_D)
    install_shared_input(mlp, ("gate_proj", "up_proj"), TensorMode.THREE_D)
    return layer


def _laid_out(cfg, mesh, sp: bool, seed: int):
    """A 1-layer Transformer built on meta and laid out on ``mesh`` by ``gridshard.parallelize``."""
    import torch

    from gridshard import parallelize
    from gridshard.models import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return parallelize(model, mesh, sequence_parallel=sp, seed=seed, device="cpu")


def _grid_cut(mesh):
    """Global [b, s, h] → this rank's block on a 2D / 2.5D job mesh: the data replica's rows, then
    batch block ``batch_index`` of ``batch_blocks`` (2D: grid row i of q; 2.5D: k·q + i of d·q),
    hidden block ``grid_col`` of q."""
    def cut(t):
        t = t.chunk(mesh.data.size, 0)[mesh.data.rank]
        return t.chunk(mesh.batch_blocks, 0)[mesh.batch_index].chunk(mesh.q, -1)[mesh.grid_col].contiguous()
    return cut


def _flat_grad_sum(params, axis):
    """The training step's gradient sum over weight replicas: one all-reduce of every gradient
    of the rank, as one flat buffer, over ``axis``."""
    import torch

    from gridshard.comm import collectives as C

    def sync():
        flat = C.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), axis, inplace=True)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))
    return sync


def _build(mode: str, a, cfg, ref_layer):
    """(layer, cut, params, sync, grad_errors) of ``mode`` on this rank; ``grad_errors(refs)``:
    {name: (max |Δ|, max |ref|)} of every parameter gradient against ``refs`` (name → the
    reference layer's gradient)."""
    from gridshard import build_mesh
    from gridshard.parallel import context_of, gather_canonical

    if mode == "3d":
        mesh = build_mesh(1, 1, WORLD, "3d")
        model, cut, sync = _laid_out(cfg, mesh, False, a.seed), lambda t: mesh.cube.batch_block(t).contiguous(), None
    elif mode == "3d-layers":
        from gridshard.tensor.tp3d.mesh import build_mesh_3d
        from gridshard.nn.sharding import take_shard

        mesh = build_mesh_3d(Q)
        layer = build_3d_layer(ref_layer, cfg, mesh)

        def grad_errors(refs):
            out = {}
            for name, p in layer.named_parameters():
                spec = p.shard_spec
                want = take_shard(spec.from_canonical(refs[name]), spec, mesh.coords(), mesh.sizes())
                out[name] = _diff(p.grad, want)
            return out
        return layer, lambda t: mesh.batch_block(t).contiguous(), list(layer.parameters()), None, grad_errors
    elif mode in ("1d", "1d+sp"):
        sp = mode == "1d+sp"
        mesh = build_mesh(1, 1, WORLD, "1d")
        # SP: the sequence block stored sequence-first, as the SP embedding hands it to the layers
        cut = (lambda t: t.chunk(WORLD, 1)[mesh.tensor.rank].transpose(0, 1).contiguous().transpose(0, 1)) if sp \
            else (lambda t: t)
        model, sync = _laid_out(cfg, mesh, sp, a.seed), None
    else:
        mesh = build_mesh(DATA_2D, 1, Q * Q, "2d") if mode == "2d" else build_mesh(1, 1, WORLD, "2.5d", depth=DEPTH)
        model, cut = _laid_out(cfg, mesh, False, a.seed), _grid_cut(mesh)
    layer, ctx = model.layers[0], context_of(model)
    params = list(layer.parameters())
    if mode in ("2d", "2.5d"):
        sync = _flat_grad_sum(params, mesh.data_context)

    def grad_errors(refs):
        return {name: _diff(gather_canonical(p.grad, ctx.layouts["layers.0." + name], mesh), refs[name])
                for name, p in layer.named_parameters()}
    return layer, cut, params, sync, grad_errors


def _diff(got, want) -> tuple:
    return float((got.detach().float() - want.detach().float()).abs().max()), float(want.detach().abs().max())


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def measure(a) -> dict:
    """On every rank of an 8-rank gloo job: mode → this rank's measurements (module docstring);
    ``"1 dev"``: the single-device reference (timed on rank 0 alone)."""
    import torch.distributed as dist

    from gridshard import LEDGER, build_mesh
    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.models.rope import rope_tables
    from gridshard.testing.inputs import randn
    from gridshard.testing.live_bytes import LiveBytesMeter

    cfg = model_config(a)
    rank = dist.get_rank()
    X, G = randn((a.batch, a.seq, a.hidden), a.seed + 1), randn((a.batch, a.seq, a.hidden), a.seed + 2)
    cos, sin = rope_tables(a.seq, cfg.head_dim, cfg.rope_theta)
    ref = _laid_out(cfg, build_mesh(WORLD, 1, 1, "none"), False, a.seed).layers[0]   # whole on every rank
    rows = {"1 dev": (ref, lambda t: t, list(ref.parameters()), None, None)}
    for mode in a.modes:
        rows[mode] = _build(mode, a, cfg, ref)

    steps, out = {}, {}
    for mode, (layer, cut, params, sync, _) in rows.items():
        x_loc, g_loc = cut(X), cut(G)

        def step(layer=layer, x_loc=x_loc, g_loc=g_loc, sync=sync):
            layer.zero_grad(set_to_none=True)
            x = x_loc.detach().requires_grad_(True)
            y = layer(x, cos, sin)
            y.backward(g_loc)
            if sync is not None:
                sync()
            return y, x.grad
        steps[mode] = step

    y_ref, gx_ref = steps["1 dev"]()
    refs = {name: p.grad.clone() for name, p in ref.named_parameters()}
    for mode, (layer, cut, params, sync, grad_errors) in rows.items():
        r = out[mode] = {"params": _param_bytes(params)}
        if mode != "1 dev":
            LEDGER.reset()
            y, gx = steps[mode]()
            r["wire"], r["calls"] = LEDGER.total("wire_bytes"), LEDGER.count()
            r["errors"] = {"output": _diff(y, cut(y_ref)), "input grad": _diff(gx, cut(gx_ref)), **grad_errors(refs)}
        layer.zero_grad(set_to_none=True)
        x = cut(X).detach().requires_grad_(True)
        with SavedTensorMeter(exclude=list(layer.parameters()) + [cos, sin]) as meter:
            y = layer(x, cos, sin)
        r["saved"] = meter.bytes
        del x, y
        layer.zero_grad(set_to_none=True)
        with LiveBytesMeter() as live:
            steps[mode]()
        r["peak"] = live.peak
        layer.zero_grad(set_to_none=True)
        r["times"], r["cpu"] = [], []

    order = list(rows)
    for rnd in range(a.rounds + 1):                     # round 0: warm-up, not recorded
        k = rnd % len(order)
        for mode in order[k:] + order[:k]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if mode != "1 dev" or rank == 0:
                steps[mode]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rnd:
                out[mode]["times"].append(dt)
                out[mode]["cpu"].append(dc)
    dist.barrier()
    return out


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

HEADERS = ["mode", "layout", "step ms", "range", "CPU ms", "wire KiB", "calls", "= theory", "peak MiB",
           "saved KiB", "/ 1 dev", "table", "model KiB", "param KiB", "max rel err"]
PREDICTED = {"1d": None, "1d+sp": 1 / WORLD, "2d": 1 / (DATA_2D * Q * Q), "2.5d": 1 / (DEPTH * Q * Q),
             "3d": 1 / Q ** 3, "3d-layers": 1 / Q ** 3}


def summarize(per_rank: list, a) -> list:
    """One dict per row (the reference first) from the per-rank results of :func:`measure`."""
    rows = []
    ref_saved = per_rank[0]["1 dev"]["saved"]
    for mode in ["1 dev", *a.modes]:
        rs = [r[mode] for r in per_rank]
        times = step_times_of_job([r["times"] for r in rs])
        cpu = [sum(c) for c in zip(*[r["cpu"] for r in rs])]
        row = {"mode": mode, "layout": LAYOUTS.get(mode, "1 process"), "step_ms": median(times) * 1e3,
               "lo": min(times) * 1e3, "hi": max(times) * 1e3, "cpu_s": median(cpu),
               "peak": max(r["peak"] for r in rs), "saved": max(r["saved"] for r in rs),
               "params": max(r["params"] for r in rs)}
        row["saved_ratio"] = row["saved"] / ref_saved
        if mode != "1 dev":
            row["wire"], row["calls"] = max(r["wire"] for r in rs), max(r["calls"] for r in rs)
            row["theory_wire"], row["theory_calls"] = theory_volume(mode, a)
            row["theory_ok"] = (all(abs(r["wire"] - row["theory_wire"]) < 0.5 for r in rs)
                                and all(r["calls"] == row["theory_calls"] for r in rs))
            row["model_saved"] = model_saved_bytes(mode, a)
            keys = rs[0]["errors"]
            row["errors"] = {k: max(r["errors"][k][0] for r in rs) / max(r["errors"][k][1] for r in rs) for k in keys}
            row["max_err"] = max(row["errors"].values())
        rows.append(row)
    return rows


def table(rows) -> str:
    cells = []
    for r in rows:
        ref = r["mode"] == "1 dev"
        pred = PREDICTED.get(r["mode"])
        cells.append([
            r["mode"], r["layout"], f"{r['step_ms']:.1f}", f"{r['lo']:.0f}–{r['hi']:.0f}", f"{r['cpu_s'] * 1e3:.0f}",
            "—" if ref else f"{r['wire'] / KiB:.1f}", "—" if ref else r["calls"],
            "—" if ref else ("yes" if r["theory_ok"] else f"NO ({r['theory_wire'] / KiB:.1f}, {r['theory_calls']})"),
            f"{r['peak'] / MiB:.2f}", f"{r['saved'] / KiB:.0f}", f"{r['saved_ratio']:.3f}",
            "1" if ref else ("—" if pred is None else f"1/{round(1 / pred)}"),
            "—" if ref or r["model_saved"] is None else f"{r['model_saved'] / KiB:.0f}",
            f"{r['params'] / KiB:.1f}", "—" if ref else f"{r['max_err']:.1e}"])
    return format_table(HEADERS, cells)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="global batch b (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs every mode once)")
    p.add_argument("--modes", nargs="+", choices=list(LAYOUTS), default=list(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--theory", action="store_true", help="print the formulas' table for the shape, start no ranks")
    a = p.parse_args(argv)
    check_shape(a)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.theory:
        print(f"Theory, b={a.batch} s={a.seq} h={a.hidden} heads={a.heads} kv_heads={a.kv_heads} f={a.ffn}, fp32, "
              f"per rank per step")
        print(theory_table(a))
        return
    import torch

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    per_rank = run_on_fresh_ranks(WORLD, measure, a, timeout=a.timeout)
    load1 = os.getloadavg()
    print(f"Decoder block on {WORLD} ranks, fp32 CPU/gloo, 1 thread/rank, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; b={a.batch} s={a.seq} h={a.hidden} heads={a.heads} kv_heads={a.kv_heads} "
          f"f={a.ffn}; forward + backward (+ gradient sum), median of {a.rounds} interleaved rounds; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after ({time.perf_counter() - t0:.0f} s)")
    print(table(summarize(per_rank, a)))


if __name__ == "__main__":
    main()
