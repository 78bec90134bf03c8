#!/usr/bin/env bash
# The one-command GPU check (issue 27; docs/gpu.md "The GPU check"). Runs as it is on a lent
# machine, within 9 minutes:
#   bash benchmarks/gpu_check.sh            # results: $OUT/summary.json, $OUT/metrics.jsonl
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh   # the same steps on the CPU (gloo, tiny shapes)
#   GPU_CHECK_SCRIPT=benchmarks/bench_gpu_step.py bash benchmarks/gpu_check.sh   # issue 44's step benchmark instead
# Python: the machine's python3 (the device image's holds CUDA PyTorch), else .venv/bin/python.
# Packages `import gridshard` needs beyond torch come, when missing, from gpu-wheels/ (`make
# gpu-wheels` here, then `carry: ["gpu-wheels"]`), installed into a temporary target dir.
# Run directories and checkpoints go to a temporary folder, never under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
if [ -n "${PY:-}" ]; then :
elif command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then PY=python3
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else echo "gpu_check: no Python with torch (python3 or .venv/bin/python)" >&2; exit 2; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c "import gridshard.cli" 2>/dev/null; then
  if [ ! -d gpu-wheels ]; then
    echo "gpu_check: 'import gridshard' fails and there is no gpu-wheels/: run 'make gpu-wheels' and carry it" >&2
    "$PY" -c "import gridshard.cli"; exit 2
  fi
  SITE=$(mktemp -d /tmp/gpu_check_site.XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links gpu-wheels \
    --target "$SITE" gpu-wheels/*.whl || exit 2
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH#$REPO}"
  "$PY" -c "import gridshard.cli" || exit 2
fi
export OUT="${OUT:-$REPO/runs/gpu_check}"
mkdir -p "$OUT"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.cuda.is_available(), torch.cuda.device_count())"
exec "$PY" "${GPU_CHECK_SCRIPT:-benchmarks/gpu_check.py}" "$@"
