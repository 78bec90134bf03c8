"""The one-command GPU check (issue 27), driven by ``benchmarks/gpu_check.sh``.

Runs on a lent machine as it is: each training check is a child process of this script
(``--child``: a fresh CUDA context, its own time limit; a failure is recorded in the summary
and the other checks go on). Run directories live under a temporary folder outside ``$OUT``
(a 125m checkpoint is ~1.5 GB); only ``summary.json`` and one ``metrics.jsonl`` (every
check's metrics lines, each tagged with ``"check"``) are written to ``$OUT``.

Single-GPU checks (``docs/gpu.md`` lists what each asserts):

* A ``bf16``: 125m preset, bf16, D=P=T=1, seq 1024 → ``tokens_per_s``, ``mfu``,
  ``peak_mem_bytes`` (medians / max over log intervals after the first), and
  ``host_syncs_after_step1``: host-device synchronisations inside ``Trainer.step`` for every
  step after the first, counted with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning
  per synchronising call; log steps' reads of the loss are outside ``Trainer.step`` and not
  counted — they are the intended syncs).
* B ``compile``: the same with ``train.compile=true``: ``recompiles`` = Dynamo graphs compiled
  after the first step (``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` growth;
  ≤ 2), ``compile_ratio`` = compiled / eager median step time, losses within 2 % of A.
* C ``fp16``: finite losses, the loss scale at the end, fused AdamW on CUDA.
* D ``fp32``: ``predicted_mem_bytes`` against max allocated / reserved.
* E ``offload``: ``train.offload=optimizer``: losses equal to D's (rel. 1e-3), step-time ratio.
* F ``resume``: 10 steps saving at 5; a second run resumes from step 5: steps 6–10 within
  ``RESUME_RTOL`` of the first run's.
* G ``sdpa``: flash-attention kernel only (``sdpa_kernel(FLASH_ATTENTION)``), MHA and GQA.
* J ``document_masks``: the bf16 step with packed, document-masked windows beside A's; on CUDA the
  ring's masked block kernel against the matmul one and the mask kernels' times
  (:func:`check_j_document_masks`).

Multi-GPU: :data:`MULTI_GPU_RUNS` through ``torch.distributed.run`` when at least the run's GPU
count is visible; otherwise skipped with a message. ``GPU_CHECK_DRY=1``: the same steps on the
CPU with gloo and tiny shapes; checks that need CUDA say "skipped: no CUDA".
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = os.environ.get("GPU_CHECK_DRY", "") not in ("", "0")
NO_CUDA = "skipped: no CUDA"
COMPILE_LOSS_RTOL = 0.02          # B: compiled vs eager losses
OFFLOAD_LOSS_RTOL = 1e-3          # E: offloaded vs on-device AdamW (same fp32 math, other kernels)
RESUME_RTOL = 0.01                # F: GPU resume is not bitwise (atomics); bf16 ~1 %
MAX_RECOMPILES = 2
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "450"))   # no new check starts after this (run limit 540 s)


def sizes() -> dict:
    """Shapes and steps: the issue's on a GPU, tiny ones for the dry run."""
    if DRY:
        return dict(preset="tiny", seq=64, batch=2, steps=6, log=2, child_timeout=180)
    return dict(preset="125m", seq=1024, batch=8, steps=30, log=10, child_timeout=240)


def base_overrides(precision: str, steps=None) -> list:
    s = sizes()
    return [f"model.preset={s['preset']}", "data.kind=stdlib", f"data.seq_len={s['seq']}",
            f"train.global_batch={s['batch']}", f"train.micro_batch={s['batch']}",
            f"train.steps={steps or s['steps']}", f"train.log_interval={s['log']}", "train.warmup_steps=2",
            f"train.precision={precision}", "parallel.data=1", "parallel.tensor=1", "parallel.tensor_mode=none",
            "parallel.pipeline=1", f"parallel.backend={'gloo' if DRY else 'auto'}", "train.eval_interval=0"]


# ---- the child: one training run in this process, instrumented ----------------------------
def child_main(run_dir: str, result_path: str, overrides: list) -> None:
    """Train once with ``overrides``; write losses, step counts of syncs and recompiles and the
    metrics records to ``result_path`` (JSON)."""
    import torch

    from gridshard.engine.trainer import Trainer
    from gridshard.mesh import init_distributed

    backend = next((o.split("=", 1)[1] for o in overrides if o.startswith("parallel.backend=")), "auto")
    init_distributed(backend)
    trainer = Trainer(None, run_dir=run_dir, progress=False, overrides=overrides)
    counts = {"host_syncs_after_step1": None, "graphs_after_step1": 0}
    cuda = trainer.device.type == "cuda"
    first = trainer.start_step
    plain_step = trainer.step

    def counted_step(k):
        if not cuda or k == first:
            out = plain_step(k)
            counts["graphs_at_step1"] = _dynamo_graphs()
            return out
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = plain_step(k)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message).lower() for w in seen)
        counts["host_syncs_after_step1"] = (counts["host_syncs_after_step1"] or 0) + syncs
        return out

    trainer.step = counted_step
    losses = trainer.run()
    counts["graphs_after_step1"] = _dynamo_graphs() - counts.get("graphs_at_step1", 0)
    opt = trainer.optimizer
    fused = bool(getattr(opt, "defaults", {}).get("fused")) if hasattr(opt, "defaults") else None
    result = {"losses": losses, "records": trainer.history, "device": str(trainer.device),
              "device_name": torch.cuda.get_device_name(trainer.device) if cuda else "cpu",
              "fused_optimizer": fused, **counts}
    with open(result_path, "w") as f:
        json.dump(result, f)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - no dynamo: no graphs
        return 0


# ---- the parent: launching children, comparing, summarising ---------------------------------
class Ctx:
    """Where runs go (``work``, outside $OUT), what comes back (``out``), and the results."""

    def __init__(self, work: str, out: str):
        self.work, self.out, self.runs, self.summary = work, out, {}, {}
        self.cuda_count = _cuda_count()

    def train(self, name: str, overrides: list, nproc: int = 1) -> dict:
        """One child run named ``name`` (cached); raises with the child's output tail on failure."""
        if name in self.runs:
            return self.runs[name]
        run_dir, result = os.path.join(self.work, name), os.path.join(self.work, name + ".json")
        if nproc == 1:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", run_dir, result, *overrides]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m",
                   "gridshard", "train", "--no-progress", "--run-dir", run_dir, *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=sizes()["child_timeout"])
        if proc.returncode != 0:
            raise RuntimeError(f"{name} exited {proc.returncode}: {_failure_text(proc.stdout + proc.stderr)}")
        data = json.load(open(result)) if nproc == 1 else {"records": _read_metrics(run_dir)}
        data["wall_s"] = round(time.perf_counter() - t0, 1)
        self._keep_metrics(name, run_dir)
        self.runs[name] = data
        return data

    def _keep_metrics(self, name: str, run_dir: str) -> None:
        with open(os.path.join(self.out, "metrics.jsonl"), "a") as f:
            for rec in _read_metrics(run_dir):
                f.write(json.dumps({"check": name, **rec}) + "\n")


def _failure_text(output: str) -> str:
    """The lines that name the error (gridshard's one-line errors, exceptions), then the tail."""
    named = [ln for ln in output.splitlines() if "error" in ln.lower() and "warn" not in ln.lower()][:4]
    return " | ".join(named)[:1200] + " ... " + output[-600:]


def _read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _cuda_count() -> int:
    if DRY:
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _steady(records: list) -> list:
    """Log records after the first interval (compile, allocator warm-up); all when only one."""
    rows = [r for r in records if r.get("tokens_per_s") is not None]
    return rows[1:] or rows


def _median(records: list, key: str):
    vals = [r[key] for r in _steady(records) if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _max_rel_diff(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in pairs), default=math.inf)


def check_a_bf16(ctx: Ctx) -> dict:
    r = ctx.train("A_bf16", base_overrides("bf16"))
    out = {"tokens_per_s": _median(r["records"], "tokens_per_s"), "mfu": _median(r["records"], "mfu"),
           "peak_mem_bytes": max((x.get("peak_mem_bytes") or 0) for x in r["records"]),
           "host_syncs_after_step1": r["host_syncs_after_step1"] if ctx.cuda_count else NO_CUDA,
           "device_name": r["device_name"], "losses": r["losses"]}
    if ctx.cuda_count and r["host_syncs_after_step1"]:
        out["error"] = f"{r['host_syncs_after_step1']} host syncs inside steps after step 1 (expected 0)"
    return out


def check_b_compile(ctx: Ctx) -> dict:
    eager = ctx.train("A_bf16", base_overrides("bf16"))
    comp = ctx.train("B_compile", base_overrides("bf16") + ["train.compile=true"])
    ratio = _median(comp["records"], "step_time_s") / _median(eager["records"], "step_time_s")
    diff = _max_rel_diff(comp["losses"], eager["losses"])
    out = {"compile_ratio": ratio, "recompiles": comp["graphs_after_step1"], "max_loss_rel_diff": diff}
    errors = []
    if comp["graphs_after_step1"] > MAX_RECOMPILES:
        errors.append(f"{comp['graphs_after_step1']} recompiles after step 1 (at most {MAX_RECOMPILES})")
    if diff > COMPILE_LOSS_RTOL:
        errors.append(f"compiled losses differ from eager by {diff:.3g} (at most {COMPILE_LOSS_RTOL})")
    return {**out, **({"error": "; ".join(errors)} if errors else {})}


def check_c_fp16(ctx: Ctx) -> dict:
    if not ctx.cuda_count:
        return {"status": NO_CUDA}
    r = ctx.train("C_fp16", base_overrides("fp16"))
    finite = all(x is not None and math.isfinite(x) for x in r["losses"][2:])
    scales = [x.get("loss_scale") for x in r["records"]]
    out = {"finite_losses": finite, "loss_scales": scales, "fused_optimizer": r["fused_optimizer"]}
    if not finite or not r["fused_optimizer"]:
        out["error"] = f"finite losses after step 2: {finite}; fused AdamW: {r['fused_optimizer']}"
    return out


def check_d_fp32(ctx: Ctx) -> dict:
    r = ctx.train("D_fp32", base_overrides("fp32", steps=10))
    last = r["records"][-1]
    pred, alloc, res = last.get("predicted_mem_bytes"), last.get("peak_mem_bytes"), last.get("peak_mem_reserved_bytes")
    return {"predicted_mem_bytes": pred, "max_allocated_bytes": alloc, "max_reserved_bytes": res,
            "predicted_over_allocated": pred / alloc if pred and alloc else None, "losses": r["losses"]}


def check_e_offload(ctx: Ctx) -> dict:
    plain = ctx.train("D_fp32", base_overrides("fp32", steps=10))
    off = ctx.train("E_offload", base_overrides("fp32", steps=10) + ["train.offload=optimizer"])
    diff = _max_rel_diff(off["losses"], plain["losses"])
    ratio = _median(off["records"], "step_time_s") / _median(plain["records"], "step_time_s")
    out = {"max_loss_rel_diff": diff, "step_time_ratio": ratio}
    if diff > OFFLOAD_LOSS_RTOL:
        out["error"] = f"offloaded losses differ from on-device ones by {diff:.3g} (at most {OFFLOAD_LOSS_RTOL})"
    return out


def check_f_resume(ctx: Ctx) -> dict:
    first = ctx.train("F_first", base_overrides("bf16", steps=10) + ["train.save_interval=5"])
    ckpt = os.path.join(ctx.work, "F_first", "checkpoints", "step_5")
    if not os.path.isdir(ckpt):
        ckpt = os.path.join(ctx.work, "F_first")
    second = ctx.train("F_resumed", base_overrides("bf16", steps=10) + [f"train.resume={ckpt}"])
    diff = _max_rel_diff(second["losses"][-5:], first["losses"][-5:])
    out = {"resumed_from": os.path.basename(ckpt), "max_loss_rel_diff_steps_6_10": diff}
    if diff > RESUME_RTOL:
        out["error"] = f"resumed steps 6-10 differ by {diff:.3g} (at most {RESUME_RTOL})"
    return out


def check_g_sdpa(ctx: Ctx) -> dict:
    if not ctx.cuda_count:
        return {"status": NO_CUDA}
    code = ("import torch,json\nfrom torch.nn.attention import sdpa_kernel, SDPBackend\n"
            "F=torch.nn.functional.scaled_dot_product_attention\nout={}\n"
            "for name,kv in (('mha',12),('gqa',4)):\n"
            " q=torch.randn(2,12,1024,64,device='cuda',dtype=torch.bfloat16)\n"
            " k=torch.randn(2,kv,1024,64,device='cuda',dtype=torch.bfloat16);v=torch.randn_like(k)\n"
            " try:\n  with sdpa_kernel(SDPBackend.FLASH_ATTENTION):\n"
            "   F(q,k,v,is_causal=True,enable_gqa=kv!=12).sum().item()\n  out[name]='flash ok'\n"
            " except Exception as e: out[name]='no flash: '+str(e).splitlines()[0][:200]\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-1500:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if any(not v.startswith("flash ok") for v in out.values()):
        out["error"] = "the flash kernel refused a case"
    return out


def check_h_memory_snapshot(ctx: Ctx) -> dict:
    """train.profile_memory on CUDA: the allocator history after the profiled steps, a pickle for
    pytorch.org/memory_viz (refused without a GPU, so nothing to run on the dry run)."""
    if not ctx.cuda_count:
        return {"status": NO_CUDA}
    ctx.train("H_memory", base_overrides("bf16", steps=4) + ["train.profile_memory=true", "train.profile_start=2",
                                                              "train.profile_steps=2"])
    path = os.path.join(ctx.work, "H_memory", "profile", "rank0.memory.pickle")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return {"snapshot_bytes": size, **({} if size else {"error": f"no memory snapshot at {path}"})}


def check_i_emulate(ctx: Ctx) -> dict:
    """gridshard emulate: rank 0 of an 8-rank ZeRO-3 layout of the check's model, on this device,
    against the memory model's peak (issue 44: within 10 %) and the planner's compute."""
    s = sizes()
    args = [sys.executable, "-m", "gridshard", "emulate", "--gpus", "8" if not DRY else "2", "--ranks", "first",
            "--steps", "3", "--json", "--hardware", "h200" if ctx.cuda_count else "cpu",
            f"model.preset={s['preset']}", "data.kind=stdlib", f"data.seq_len={s['seq']}",
            f"train.global_batch={s['batch'] * (8 if not DRY else 2)}", f"train.micro_batch={s['batch']}",
            "train.precision=bf16", "train.zero=3", f"parallel.data={8 if not DRY else 2}", "parallel.tensor=1",
            "parallel.tensor_mode=none", "parallel.pipeline=1", "train.eval_interval=0"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=s["child_timeout"])
    if proc.returncode:
        raise RuntimeError(_failure_text(proc.stdout + proc.stderr))
    rank = json.loads(proc.stdout)[0]
    ratio = rank["peak_bytes"] / rank["predicted_peak_bytes"] if rank["predicted_peak_bytes"] else None
    out = {"peak_bytes": rank["peak_bytes"], "predicted_peak_bytes": rank["predicted_peak_bytes"],
           "peak_over_predicted": ratio, "compute_s": rank["compute_s"],
           "predicted_compute_s": rank["predicted_compute_s"], "comm_bytes": rank["comm_bytes"]}
    if ctx.cuda_count and ratio is not None and not 0.9 <= ratio <= 1.1:
        out["error"] = f"emulated peak {ratio:.2f}x the predicted (issue 44: within 10 %)"
    return out


# name, GPUs, overrides beyond base_overrides("bf16") (parallel.* there are replaced)
MULTI_GPU_RUNS = [
    ("M_D2", 2, ["parallel.data=2"]),
    ("M_T2", 2, ["parallel.tensor=2", "parallel.tensor_mode=1d"]),
    ("M_T2_SP", 2, ["parallel.tensor=2", "parallel.tensor_mode=1d", "parallel.sequence_parallel=true"]),
    ("M_T2_no_overlap", 2, ["parallel.tensor=2", "parallel.tensor_mode=1d", "parallel.overlap_input_grad=false"]),
    ("M_2D_q2", 4, ["parallel.tensor=4", "parallel.tensor_mode=2d"]),
    ("M_P2_1f1b", 2, ["parallel.pipeline=2", "parallel.pipeline_schedule=1f1b", "train.micro_batch=2"]),
    ("M_P2_zb", 2, ["parallel.pipeline=2", "parallel.pipeline_schedule=zero_bubble", "train.micro_batch=2"]),
    ("M_D2_zero1", 2, ["parallel.data=2", "train.zero=1"]),
    ("M_D2_zero2", 2, ["parallel.data=2", "train.zero=2"]),
    ("M_D2_zero3", 2, ["parallel.data=2", "train.zero=3"]),
    ("M_D2_zero2_fp16", 2, ["parallel.data=2", "train.zero=2", "train.precision=fp16"]),
]


def check_multi_gpu(ctx: Ctx) -> dict:
    """The multi-GPU runs that fit the visible GPUs, then the D2→T2 reshard (the dry run: D=2 and
    the reshard, over gloo)."""
    runs = MULTI_GPU_RUNS[:1] if DRY else [r for r in MULTI_GPU_RUNS if r[1] <= ctx.cuda_count]
    if not runs:
        return {"status": f"skipped: {ctx.cuda_count} GPU(s) visible, the multi-GPU section needs 2 or more"}
    out = {}
    for name, _gpus, extra in runs:
        try:
            half = [f"train.micro_batch={max(1, sizes()['batch'] // 2)}"]     # D=2: G = 2 micro-batches
            r = ctx.train(name, base_overrides("bf16", steps=sizes()["log"] * 2) + half + extra, nproc=_gpus)
            last = r["records"][-1]
            out[name] = {"loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s")}
        except Exception as e:  # noqa: BLE001 - each run's failure is recorded, the next goes on
            out[name] = {"error": str(e)[-800:]}
    if DRY or ctx.cuda_count >= 2:
        out["M_reshard_D2_T2"] = _reshard(ctx)
    failed = [n for n, r in out.items() if "error" in r]
    return {**out, **({"error": f"failed: {', '.join(failed)}"} if failed else {})}


def _reshard(ctx: Ctx) -> dict:
    try:
        src = os.path.join(ctx.work, "M_D2")
        r = ctx.train("M_reshard_T2", base_overrides("bf16", steps=sizes()["log"] * 3) + [
            "parallel.tensor=2", "parallel.tensor_mode=1d", f"train.resume={src}",
            "train.allow_changed_schedule=true"], nproc=2)
        return {"loss": r["records"][-1].get("loss")}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[-800:]}


_MASK_KERNELS = """
import json, time, torch
from gridshard.context.blocks import CUDA_EFFICIENT, MATMUL
from gridshard.nn.documents import attention_mask
F = torch.nn.functional.scaled_dot_product_attention
out, g = {}, torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
docs = (torch.arange(1024, device="cuda") // 100).unsqueeze(0)
pos = torch.arange(512, device="cuda")
mask = attention_mask(docs[:, 512:], docs[:, :512], pos + 512, pos)
o1, l1 = CUDA_EFFICIENT.forward(q, k, v, 0.125, False, mask)
o2, l2 = MATMUL.forward(q, k, v, 0.125, False, mask)
out["ring_block_forward_max_abs_diff"] = float((o1.float() - o2.float()).abs().max())
d1 = CUDA_EFFICIENT.backward(o1, q, k, v, o1, l2, 0.125, False, mask)
d2 = MATMUL.backward(o1, q, k, v, o1, l2, 0.125, False, mask)
out["ring_block_backward_max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(d1, d2))
S = 4096
q = torch.randn(1, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 4, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
docs = (torch.arange(S, device="cuda") // 256).unsqueeze(0)
add = torch.zeros(1, 1, S, S, device="cuda", dtype=torch.bfloat16).masked_fill_(~attention_mask(docs, docs), float("-inf"))
rows = {"causal": lambda: F(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa_additive_mask": lambda: F(q, k, v, attn_mask=add, enable_gqa=True)}
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    block = create_block_mask(lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (j <= i), 1, None, S, S, device="cuda")
    flex = torch.compile(flex_attention)
    rows["flex_compiled"] = lambda: flex(q, k, v, block_mask=block, enable_gqa=True)
except Exception as e:
    out["flex"] = str(e).splitlines()[0][:200]
for name, fn in rows.items():
    for _ in range(3):
        fn().sum().backward()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10):
        fn().sum().backward()
    torch.cuda.synchronize(); out[name + "_ms"] = (time.perf_counter() - t0) * 100
print(json.dumps(out))
"""


def check_j_document_masks(ctx: Ctx) -> dict:
    """Packed windows with document masks (issue 41): the bf16 step with first_fit packing and masks
    beside A's (``mask_step_ratio``, finite losses); on CUDA the ring's masked efficient-attention
    block against the matmul block (forward and backward), and fwd+bwd milliseconds of causal SDPA,
    SDPA with the additive document mask and compiled flex_attention at S = 4096, documents of 256."""
    plain = ctx.train("A_bf16", base_overrides("bf16"))
    packed = ctx.train("J_packed", base_overrides("bf16") + ["data.packing=first_fit", "data.document_mask=true",
                                                             "data.eod_token=10"])
    out = {"mask_step_ratio": _median(packed["records"], "step_time_s") / _median(plain["records"], "step_time_s"),
           "losses": packed["losses"]}
    if not all(x is not None and math.isfinite(x) for x in packed["losses"]):
        out["error"] = "non-finite losses with document masks"
    if not ctx.cuda_count:
        return {**out, "kernels": NO_CUDA}
    proc = subprocess.run([sys.executable, "-c", _MASK_KERNELS], capture_output=True, text=True, timeout=180,
                          cwd=REPO)
    if proc.returncode:
        return {**out, "error": "mask kernels: " + proc.stderr[-1500:]}
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    if max(kernels["ring_block_forward_max_abs_diff"], kernels["ring_block_backward_max_abs_diff"]) > 0.05:
        out["error"] = "the masked efficient-attention block differs from the matmul block"
    return {**out, "kernels": kernels}


CHECKS = [("A_bf16", check_a_bf16), ("B_compile", check_b_compile), ("C_fp16", check_c_fp16),
          ("D_fp32", check_d_fp32), ("E_offload", check_e_offload), ("F_resume", check_f_resume),
          ("G_sdpa", check_g_sdpa), ("H_memory_snapshot", check_h_memory_snapshot), ("I_emulate", check_i_emulate),
          ("J_document_masks", check_j_document_masks),
          ("multi_gpu", check_multi_gpu)]
HEADLINE = ("tokens_per_s", "mfu", "peak_mem_bytes", "host_syncs_after_step1", "compile_ratio", "recompiles")


def run_checks(ctx: Ctx) -> dict:
    """Every check in order; an exception is recorded as that check's ``error``, never fatal."""
    checks, t_start = {}, time.perf_counter()
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        if t0 - t_start > BUDGET_S:
            checks[name] = {"status": f"skipped: over the {BUDGET_S:.0f} s budget (GPU_CHECK_BUDGET_S)", "seconds": 0}
            print(f"[gpu_check] {name}: {checks[name]['status']}", flush=True)
            continue
        try:
            checks[name] = fn(ctx)
        except Exception as e:  # noqa: BLE001 - recorded, the next check runs
            checks[name] = {"error": f"{type(e).__name__}: {e}"[-2000:], "trace": traceback.format_exc()[-1500:]}
        checks[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_check] {name}: {'FAIL ' + checks[name]['error'][:300] if 'error' in checks[name] else 'ok'}"
              f" ({checks[name]['seconds']} s)", flush=True)
    summary = {k: None for k in HEADLINE}
    summary.update({k: v for k, v in checks["A_bf16"].items() if k in HEADLINE})
    summary.update({k: v for k, v in checks["B_compile"].items() if k in HEADLINE})
    summary.update(dry=DRY, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpus=ctx.cuda_count,
                   python=sys.version.split()[0], torch=_torch_version(),
                   seconds=round(time.perf_counter() - t_start, 1),
                   failed=[n for n, c in checks.items() if "error" in c],
                   skipped=[n for n, c in checks.items() if str(c.get("status", "")).startswith("skipped")],
                   checks=checks)
    return summary


def _torch_version() -> str:
    import torch
    return torch.__version__


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    out = os.environ.get("OUT") or os.path.join(REPO, "runs", "gpu_check")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        os.remove(os.path.join(out, "metrics.jsonl"))
    work = tempfile.mkdtemp(prefix="gpu_check_")      # run dirs and checkpoints: never under $OUT
    try:
        summary = run_checks(Ctx(work, out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({k: summary[k] for k in (*HEADLINE, "failed", "skipped", "seconds")}, default=str), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
