"""Where ranks run (:mod:`gridshard.engine.placement`): a real launch on two simulated nodes — two
torchrun agents on this machine, ``--nnodes 2 --nproc-per-node 2`` — of a job whose tensor group
(T = 4) spans both, which ``gridshard diagnose`` reports with the override that keeps it inside a
node."""
import json
import os
import subprocess
import sys

from gridshard.diagnose import diagnose
from gridshard.netutil import free_port


def test_a_tensor_group_across_two_nodes_is_a_finding(tmp_path):
    port, run = free_port(), tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "TORCHELASTIC", "GRIDSHARD"))}
    env["OMP_NUM_THREADS"] = "1"
    train = ["-m", "gridshard", "train", "--no-progress", "--run-dir", str(run), "parallel.data=1", "parallel.tensor=4",
             "parallel.tensor_mode=1d", "data.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
             "train.steps=4", "train.log_interval=2"]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                                "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                *train], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for n in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    launch = json.loads((run / "launch.json").read_text())
    assert launch["nodes"] == ["0", "1"] and launch["ranks_per_node"] == 2
    assert [r["node"] for r in launch["ranks"]] == ["0", "0", "1", "1"] and launch["groups"]["tensor"] == [[0, 1, 2, 3]]
    found = [f for f in diagnose(str(run))["findings"] if f["finding"] == "tensor group spans nodes"]
    assert len(found) == 1 and found[0]["overrides"] == ["parallel.tensor=2", "parallel.data=2"], found
