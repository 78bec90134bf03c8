"""The training step on one GPU at its best, beside a plain PyTorch loop (issue 44).

One command, for a lent device (about 8 minutes, its own budget; results under ``$OUT``)::

    python benchmarks/bench_gpu_step.py                   # the device
    GPU_CHECK_DRY=1 python benchmarks/bench_gpu_step.py   # the same steps on the CPU, tiny shapes

What it runs, each in a child process (a fresh CUDA context, its own time limit; a failure is
recorded and the rest goes on), most important first, none started past ``--budget`` seconds:

1. **ours**: gridshard's Llama at the Llama 3.2 3B and 1B shapes (V 128256, tied head, 8 kv heads;
   3B: h 3072, 28 layers, 24 heads, f 8192; 1B: h 2048, 16 layers, 32 heads, f 8192), bf16 storage
   with fp32 masters, seq 4096, ``train.compile`` on and off. The micro-batch and recompute are the
   largest batch and lightest recompute the memory model fits on this device (the planner's rule,
   :func:`gridshard.planner.fit.predicted_peak`: 8, 4, 2, 1 sequences at ``none``, then
   ``selective``, then ``full``). Measured after the first log interval: tokens/s, MFU (the
   project's FLOP count, :func:`gridshard.theory.training.model_flops_per_token`), step seconds,
   peak allocated and reserved bytes beside ``predicted_mem_bytes``.
2. **plain**: what a careful user writes without gridshard — transformers' ``LlamaForCausalLM`` of
   the same shape (SDPA attention), fp32 weights under bf16 autocast, ``torch.compile``, fused
   AdamW, gradient clipping at 1.0 — on the same batch and sequence (with the recompute ours
   needed: transformers' gradient checkpointing, which is full recompute). The same measures.
3. **profile**: a ``torch.profiler`` trace of three steps of ours at the 3B shape, read here: the
   top kernels by device time, the host synchronisations (``cuda*Synchronize`` calls), and the
   device's idle gaps (the union of kernel intervals against the wall; the five largest gaps and
   the kernel that ends each).
4. **emulate**: ``gridshard emulate`` of rank 0 and the last rank of three published layouts —
   Llama 3.1 8B at torchtitan's FSDP layout on 8 GPUs (D8 ZeRO-3, seq 8192), a 70B layout on 64
   (D8 T8 1D+SP ZeRO-3, seq 8192) and Llama 3 405B's (D64 P16 T8 1D+SP ZeRO-2, 1F1B, seq 8192) —
   measured peak and compute beside the planner's prediction.

Written to ``$OUT`` (default ``runs/bench_gpu_step``): ``bench_gpu_step.json`` (everything) and
``bench_gpu_step.md`` (the table for docs/gpu.md, "Measured on one H200", with this command).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = os.environ.get("GPU_CHECK_DRY", "") not in ("", "0")
sys.path.insert(0, REPO)

LLAMA32 = {      # Llama 3.2's published shapes (config.json of meta-llama/Llama-3.2-1B and -3B)
    "3b": dict(vocab_size=128256, hidden=3072, layers=28, heads=24, kv_heads=8, ffn_hidden=8192,
               rope_theta=500000.0, tie_embeddings=True),
    "1b": dict(vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192,
               rope_theta=500000.0, tie_embeddings=True),
}
TINY = {
    "3b": dict(vocab_size=512, hidden=96, layers=3, heads=6, kv_heads=2, ffn_hidden=256, rope_theta=500000.0,
               tie_embeddings=True),
    "1b": dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=192, rope_theta=500000.0,
               tie_embeddings=True),
}
# (name, world, parallel, train, model) of the emulated published layouts
EMULATED = [
    ("llama3.1-8b torchtitan FSDP, 8 GPUs", 8, {"data": 8}, {"zero": 3},
     {"preset": "llama3-8b"}),
    ("llama3-70b D8 T8 1D+SP ZeRO-3, 64 GPUs", 64,
     {"data": 8, "tensor": 8, "tensor_mode": "1d", "sequence_parallel": True}, {"zero": 3},
     {"preset": "llama3-70b"}),
    ("llama3-405b D64 P16 T8 (published), 8192 GPUs", 8192,
     {"data": 64, "pipeline": 16, "tensor": 8, "tensor_mode": "1d", "sequence_parallel": True,
      "pipeline_schedule": "1f1b"}, {"zero": 2},
     {"preset": None, "vocab_size": 128256, "hidden": 16384, "layers": 126, "heads": 128, "kv_heads": 8,
      "ffn_hidden": 53248, "max_seq_len": 8192, "rope_theta": 500000.0}),
]


def sizes() -> dict:
    if DRY:
        return dict(shapes=TINY, seq=64, steps=6, log=2, child_timeout=240, emulate_seq=64)
    return dict(shapes=LLAMA32, seq=4096, steps=24, log=6, child_timeout=420, emulate_seq=8192)


def _overrides(shape: str, batch: int, recompute: str, compile_: bool, steps: int) -> list:
    s = sizes()
    model = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in s["shapes"][shape].items()]
    return ["model.preset=null", *model, f"model.max_seq_len={s['seq']}", "data.kind=stdlib",
            f"data.seq_len={s['seq']}", f"train.global_batch={batch}", f"train.micro_batch={batch}",
            f"train.steps={steps}", f"train.log_interval={s['log']}", "train.warmup_steps=2", "train.precision=bf16",
            f"train.recompute={recompute}", f"train.compile={str(compile_).lower()}", "train.eval_interval=0",
            "parallel.data=1", "parallel.tensor=1", "parallel.tensor_mode=none", "parallel.pipeline=1",
            f"parallel.backend={'gloo' if DRY else 'auto'}"]


# ---- children ------------------------------------------------------------------------------
def choose_batch(shape: str) -> tuple:
    """(micro-batch, recompute, predicted total with margin, budget) the memory model fits here."""
    from gridshard.config import resolve_config
    from gridshard.planner import fit

    budget = fit.machine_budget(1)
    for recompute in ("none", "selective", "full"):
        for batch in (8, 4, 2, 1):
            cfg = resolve_config(None, _overrides(shape, batch, recompute, False, 1), world_size=1)
            mem, _ = fit.predicted_peak(cfg, budget)
            if mem.total_with_margin <= budget.per_rank:
                return batch, recompute, mem.total_with_margin, budget.per_rank
    raise RuntimeError(f"{shape}: no batch fits {budget.per_rank} bytes")


def _steady(values: list) -> list:
    return values[1:] or values


def child_ours(shape: str, compile_: bool, work: str) -> dict:
    import torch

    from gridshard.engine.trainer import Trainer
    from gridshard.mesh import init_distributed

    batch, recompute, fits, budget = choose_batch(shape)
    init_distributed("gloo" if DRY else "auto")
    trainer = Trainer(None, run_dir=os.path.join(work, f"ours_{shape}_{compile_}"), progress=False,
                      overrides=_overrides(shape, batch, recompute, compile_, sizes()["steps"]))
    trainer.run()
    rec = _steady([r for r in trainer.history if r.get("tokens_per_s")])
    cuda = trainer.device.type == "cuda"
    out = {"batch": batch, "recompute": recompute, "predicted_with_margin_bytes": fits, "budget_bytes": budget,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rec),
           "step_s": statistics.median(r["step_time_s"] for r in rec),
           "mfu": statistics.median(r["mfu"] for r in rec) if rec[0].get("mfu") is not None else None,
           "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(trainer.device)) if cuda
           else max(r["peak_mem_bytes"] for r in rec),
           "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(trainer.device)) if cuda else None,
           "predicted_bytes": trainer.history[-1].get("predicted_mem_bytes"),
           "losses": [r["loss"] for r in trainer.history], "device": _device_name(trainer.device)}
    import torch.distributed as dist
    dist.destroy_process_group()
    return out


def child_plain(shape: str, batch: int, recompute: str) -> dict:
    """transformers' Llama of ``shape``, the loop a careful user writes (module docstring, 2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gridshard.config import resolve_config
    from gridshard.engine.metrics import device_peak_flops
    from gridshard.theory.training import mfu, model_flops_per_token

    s = sizes()
    m = s["shapes"][shape]
    device = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
    config = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["ffn_hidden"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], max_position_embeddings=s["seq"],
                         rope_theta=m["rope_theta"], tie_word_embeddings=m["tie_embeddings"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    if recompute != "none":
        model.gradient_checkpointing_enable()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    except (RuntimeError, TypeError):                # a torch without fused AdamW on this device
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    step_model = torch.compile(model)
    ids = torch.randint(0, m["vocab_size"], (batch, s["seq"]), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for _ in range(s["steps"]):
        t0 = time.perf_counter()
        losses.append(float(step()))                  # the loss read: the step's end, on the host
        times.append(time.perf_counter() - t0)
    warm = times[max(2, s["log"]):] or times
    step_s = statistics.median(warm)
    cfg = resolve_config(None, _overrides(shape, batch, recompute, True, 1), world_size=1)
    tps = batch * s["seq"] / step_s
    peak = device_peak_flops(device, "bf16")
    return {"batch": batch, "recompute": recompute, "step_s": step_s, "tokens_per_s": tps,
            "mfu": mfu(model_flops_per_token("llama", cfg.model.resolve(), s["seq"]), tps, peak, 1),
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None,
            "losses": losses, "fused_optimizer": bool(opt.defaults.get("fused")), "device": _device_name(device)}


def child_profile(shape: str, work: str) -> dict:
    """Three steps of ours under ``torch.profiler`` (module docstring, 3), read here."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gridshard.engine.trainer import Trainer
    from gridshard.mesh import init_distributed

    batch, recompute, _, _ = choose_batch(shape)
    init_distributed("gloo" if DRY else "auto")
    trainer = Trainer(None, run_dir=os.path.join(work, f"profile_{shape}"), progress=False,
                      overrides=_overrides(shape, batch, recompute, False, 5))
    cuda = trainer.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(trainer.device)) if cuda else (lambda: None)
    for k in range(2):
        trainer.step(k)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for k in range(2, 5):
            trainer.step(k)
        sync()
    wall = time.perf_counter() - t0
    out = {"batch": batch, "recompute": recompute, "wall_s_3_steps": wall, **read_profile(prof, cuda)}
    import torch.distributed as dist
    dist.destroy_process_group()
    return out


def read_profile(prof, cuda: bool) -> dict:
    """Top kernels (device time; CPU ops' self time without CUDA), host synchronisations, and the
    device's idle gaps between kernels."""
    def self_time(e):
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    averages = sorted(prof.key_averages(), key=self_time, reverse=True)
    top = [{"name": e.key[:120], "calls": e.count, "total_ms": self_time(e) / 1e3} for e in averages[:15]]
    syncs = {e.key: e.count for e in prof.key_averages() if "ynchronize" in e.key}
    out = {"top": top, "host_syncs": syncs}
    if not cuda:
        return {**out, "gaps": "skipped: no CUDA"}
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not kernels:
        return {**out, "gaps": "no kernel events"}
    busy, gaps, (lo, hi, _) = 0.0, [], kernels[0]
    for start, end, name in kernels[1:]:
        if start > hi:
            busy += hi - lo
            gaps.append((start - hi, name))
            lo, hi = start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    gaps.sort(reverse=True)
    return {**out, "device_busy_share": busy / span if span else None, "device_span_ms": span / 1e3,
            "gaps": [{"us": g, "before_kernel": n[:120]} for g, n in gaps[:5]]}


def child_emulate(index: int) -> dict:
    from gridshard.config import resolve_config
    from gridshard.planner.emulate import emulate

    name, world, parallel, train, model = EMULATED[index]
    s = sizes()
    if DRY:         # the layout with a tiny model of the same divisibility
        model = {"preset": None, "vocab_size": 512, "hidden": 64, "layers": 16, "heads": 8, "kv_heads": 8,
                 "ffn_hidden": 128, "max_seq_len": s["emulate_seq"]}
    source = {"model": model, "parallel": parallel, "data": {"kind": "stdlib", "seq_len": s["emulate_seq"]},
              "train": {**train, "precision": "bf16", "micro_batch": 1, "recompute": "none",
                        "global_batch": parallel.get("data", 1) * (32 if parallel.get("pipeline", 1) > 1 else 1)}}
    cfg = resolve_config(source, (), world_size=world, cuda_available=not DRY)
    if DRY:
        hardware = "cpu"
    else:
        import torch
        hardware = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100"
    reports = emulate(cfg, world, [0, world - 1], steps=2, hardware=hardware)
    return {"layout": name, "ranks": [{k: r[k] for k in ("rank", "coords", "peak_bytes", "predicted_peak_bytes",
                                                          "compute_s", "predicted_compute_s", "comm_bytes")}
                                       for r in reports]}


def _device_name(device) -> str:
    import torch
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def child_main(argv) -> None:
    kind, result, *args = argv
    with tempfile.TemporaryDirectory(prefix="bench_gpu_step_child_") as work:   # run dirs: nothing is kept
        if kind == "ours":
            out = child_ours(args[0], args[1] == "1", work)
        elif kind == "plain":
            out = child_plain(args[0], int(args[1]), args[2])
        elif kind == "profile":
            out = child_profile(args[0], work)
        else:
            out = child_emulate(int(args[0]))
    with open(result, "w") as f:
        json.dump(out, f)


# ---- the parent ------------------------------------------------------------------------------
def run_child(name: str, args: list, results: dict, start: float, budget: float, work: str) -> dict:
    if time.perf_counter() - start > budget:
        results[name] = {"status": "skipped: budget"}
        return results[name]
    path = os.path.join(work, name + ".json")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", args[0], path, *args[1:]],
                              cwd=REPO, capture_output=True, text=True, timeout=sizes()["child_timeout"])
        if proc.returncode:
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
        results[name] = {"status": "ok", **json.load(open(path))}
    except Exception as e:  # noqa: BLE001 - recorded, the next runs go on
        results[name] = {"status": f"failed: {type(e).__name__}: {str(e)[-1500:]}"}
    results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {results[name]['status']} ({results[name]['wall_s']} s)", flush=True)
    return results[name]


def table(results: dict, command: str) -> str:
    gib = lambda b: f"{b / 2**30:.1f}" if b else "–"                        # noqa: E731
    pct = lambda x: f"{100 * x:.1f} %" if x is not None else "–"           # noqa: E731
    lines = [f"Measured on one {results.get('device', '?')} ({time.strftime('%Y-%m-%d')}, `{command}`):", "",
             "| shape | run | batch × seq, recompute | tokens/s | MFU | step s | peak alloc / reserved GiB | "
             "predicted GiB |", "|---|---|---|---|---|---|---|---|"]
    for shape in ("3b", "1b"):
        for run, label in ((f"ours_{shape}_compile", "gridshard, compile"), (f"ours_{shape}_eager", "gridshard, eager"),
                           (f"plain_{shape}", "transformers + compile + fused AdamW")):
            r = results.get(run, {})
            if r.get("status") != "ok":
                lines.append(f"| {shape} | {label} | {r.get('status', 'not run')[:80]} | | | | | |")
                continue
            lines.append(f"| {shape} | {label} | {r['batch']} × {sizes()['seq']}, {r['recompute']} | "
                         f"{r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | {r['step_s']:.3f} | "
                         f"{gib(r.get('peak_allocated_bytes'))} / {gib(r.get('peak_reserved_bytes'))} | "
                         f"{gib(r.get('predicted_bytes'))} |")
        ours, plain = results.get(f"ours_{shape}_compile", {}), results.get(f"plain_{shape}", {})
        eager = results.get(f"ours_{shape}_eager", {})
        if ours.get("status") == plain.get("status") == "ok":
            lines.append(f"| {shape} | ours ÷ plain step | {ours['step_s'] / plain['step_s']:.3f} | | | | | |")
        if ours.get("status") == eager.get("status") == "ok":
            lines.append(f"| {shape} | compile ÷ eager step | {ours['step_s'] / eager['step_s']:.3f} | | | | | |")
    prof = results.get("profile_3b", {})
    if prof.get("status") == "ok":
        busy, gaps = prof.get("device_busy_share"), prof.get("gaps")
        gap_text = ", ".join(f"{g['us']:.0f} us" for g in gaps) if isinstance(gaps, list) else str(gaps)
        top = "; ".join(f"{t['name'][:60]} {t['total_ms']:.1f} ms" for t in prof["top"][:5])
        lines += ["", f"Profile of three 3B steps (eager): device busy {pct(busy)} of its span; host "
                  f"synchronisations {prof['host_syncs'] or 'none'}; top kernels: {top}; largest gaps: {gap_text}"]
    lines += ["", "| emulated layout | rank | peak GiB (predicted, ratio) | compute s (predicted, ratio) |",
              "|---|---|---|---|"]
    for i in range(len(EMULATED)):
        r = results.get(f"emulate_{i}", {})
        if r.get("status") != "ok":
            lines.append(f"| {EMULATED[i][0]} | {r.get('status', 'not run')[:80]} | | |")
            continue
        for k in r["ranks"]:
            pp, pc = k["predicted_peak_bytes"], k["predicted_compute_s"]
            lines.append(f"| {r['layout']} | {k['rank']} | {gib(k['peak_bytes'])} ({gib(pp)}, "
                         f"{k['peak_bytes'] / pp:.2f}×) | {k['compute_s']:.3f} ("
                         + (f"{pc:.3f}, {k['compute_s'] / pc:.2f}×) |" if pc else "–) |"))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_GPU_BUDGET_S", "420")),
                    help="no child starts after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated: plain, profile, emulate, 3b, 1b")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out_dir = os.environ.get("OUT") or os.path.join(REPO, "runs", "bench_gpu_step")
    os.makedirs(out_dir, exist_ok=True)
    start, results = time.perf_counter(), {"dry": DRY}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_step_") as work:
        for shape in [s for s in ("3b", "1b") if s not in skip]:
            ours = run_child(f"ours_{shape}_compile", ["ours", shape, "1"], results, start, args.budget, work)
            results["device"] = ours.get("device", results.get("device"))
            if "plain" not in skip and ours.get("status") == "ok":
                run_child(f"plain_{shape}", ["plain", shape, str(ours["batch"]), ours["recompute"]], results, start,
                          args.budget, work)
            run_child(f"ours_{shape}_eager", ["ours", shape, "0"], results, start, args.budget, work)
            if shape == "3b" and "profile" not in skip:
                run_child("profile_3b", ["profile", "3b"], results, start, args.budget, work)
        if "emulate" not in skip:
            for i in range(len(EMULATED)):
                run_child(f"emulate_{i}", ["emulate", str(i)], results, start, args.budget, work)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    command = ("GPU_CHECK_DRY=1 " if DRY else "") + "python benchmarks/bench_gpu_step.py"
    md = table(results, command)
    with open(os.path.join(out_dir, "bench_gpu_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "bench_gpu_step.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        try:
            child_main(sys.argv[2:])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        main()
