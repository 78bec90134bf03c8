#!/usr/bin/env bash
# GPU smoke test and bf16 step time / MFU of the reference model on ONE GPU (T=1), for a
# session that is lent an accelerator. Prepared to run in a few minutes:
#   bash benchmarks/gpu_smoke.sh                  # writes under ${OUT:-runs/gpu_smoke}
# 1. the nccl/CUDA path of the 1D layers (examples/tp_mlp_demo.py at T=1, checked vs one device);
# 2. `gridshard train` of the 125m preset, bf16, on the stdlib byte corpus (no download):
#    metrics.jsonl carries tokens_per_s and mfu (model FLOPs / the GPU's bf16 peak).
# 3. the same run with train.compile=true (each decoder layer under torch.compile): tokens/s
#    ratio compiled / eager, and the losses of the two runs side by side.
# (One GPU measures no communication overlap: that needs >= 2 GPUs, e.g. T=2 with nccl.)
# PRESET/SEQ/MICRO/STEPS override the sizes (e.g. PRESET=tiny SEQ=128 to try it on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_smoke}
PRESET=${PRESET:-125m}; SEQ=${SEQ:-1024}; MICRO=${MICRO:-8}; STEPS=${STEPS:-40}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
$PY - <<'PYEOF' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
PYEOF
$PY -m torch.distributed.run --nproc-per-node 1 examples/tp_mlp_demo.py 2>&1 | grep -v "^W" | tee "$OUT/tp_demo.txt"
$PY -m torch.distributed.run --nproc-per-node 1 -m gridshard train --no-progress --run-dir "$OUT/train" \
  parallel.data=1 parallel.tensor=1 parallel.tensor_mode=none model.preset="$PRESET" \
  data.kind=stdlib data.seq_len="$SEQ" train.global_batch="$MICRO" train.micro_batch="$MICRO" \
  train.steps="$STEPS" train.precision=bf16 train.log_interval=10 train.warmup_steps=5 2>&1 | grep -v "^W" \
  | tee "$OUT/train.txt"
$PY -m torch.distributed.run --nproc-per-node 1 -m gridshard train --no-progress --run-dir "$OUT/train_compiled" \
  parallel.data=1 parallel.tensor=1 parallel.tensor_mode=none model.preset="$PRESET" \
  data.kind=stdlib data.seq_len="$SEQ" train.global_batch="$MICRO" train.micro_batch="$MICRO" \
  train.steps="$STEPS" train.precision=bf16 train.log_interval=10 train.warmup_steps=5 train.compile=true 2>&1 \
  | grep -v "^W" | tee "$OUT/train_compiled.txt"
$PY - "$OUT/train/metrics.jsonl" "$OUT/train_compiled/metrics.jsonl" <<'PYEOF' | tee "$OUT/summary.txt"
import json, statistics, sys
runs = {}
for name, path in zip(("eager", "compiled"), sys.argv[1:]):
    rows = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l][1:]   # drop the warm-up interval
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    runs[name] = (tps, [r["loss"] for r in rows])
    print(f"{name}: median tokens/s {tps:.0f}; " + (f"median MFU {statistics.median(mfu):.3f}" if mfu else
          "MFU unknown (no peak for this device)"))
print(f"compiled / eager tokens/s: {runs['compiled'][0] / runs['eager'][0]:.3f}")
print("losses eager   ", [round(x, 4) for x in runs["eager"][1]])
print("losses compiled", [round(x, 4) for x in runs["compiled"][1]])
PYEOF
