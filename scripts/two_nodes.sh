#!/usr/bin/env bash
# Two simulated nodes on this machine (2 workers each, c10d rendezvous on localhost) train,
# checkpoint, and a second two-node job resumes from the first one's latest checkpoint.
#   bash scripts/two_nodes.sh [RUN_DIR]
# On a real cluster the same torchrun line runs once per node with --rdzv-endpoint HOST:PORT of
# any one node (docs/checkpoints.md shows the torchrun and SLURM srun lines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${1:-runs/two_nodes}
PORT=$($PY -c "from gridshard.netutil import free_port; print(free_port())")
COMMON=(parallel.data=2 parallel.tensor=2 parallel.tensor_mode=1d data.seq_len=64 train.global_batch=8
        train.micro_batch=4 train.log_interval=2 train.save_interval=4 train.decay_steps=12)   # one schedule for both jobs
export OMP_NUM_THREADS=1

two_nodes() {   # $1: rendezvous id; rest: gridshard train arguments
  local id=$1; shift
  for node in 0 1; do
    $PY -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
      --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "$id" \
      -m gridshard train --run-dir "$RUN" --no-progress "$@" > "$RUN.node$node.$id.log" 2>&1 &
  done
  wait
}

mkdir -p "$(dirname "$RUN")"
rm -rf "$RUN"
two_nodes first "${COMMON[@]}" train.steps=8
echo "first job: $(cat "$RUN/checkpoints/latest"), $(wc -l < "$RUN/metrics.jsonl") metrics lines"
two_nodes second "${COMMON[@]}" train.steps=12 --resume latest
echo "second job: $(cat "$RUN/checkpoints/latest"), $(wc -l < "$RUN/metrics.jsonl") metrics lines"
grep -h "resumed from\|^done" "$RUN".node*.log || true
