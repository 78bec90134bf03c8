"""Hangs that say who: a rank that never joins (:mod:`gridshard.rendezvous`) and a collective that
one rank skips (:mod:`gridshard.engine.hang`), each ending in one message that names the missing
rank."""
import json
import os
import subprocess
import sys
import time

import pytest

from gridshard.cli.common import EXIT_WORKER_ERROR
from gridshard.netutil import free_port
from gridshard.testing import run_on_ranks
from gridshard.testing.multiprocess import RankFailure

TIMEOUT_S = 6


def _worker_env(rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GRIDSHARD_FAULT"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


def test_a_rank_that_never_joins_is_named_with_what_each_rank_saw(tmp_path):
    """Ranks 0–2 of WORLD_SIZE=4 start (rank 3 never does): each ends within the rendezvous timeout
    (train.collective_timeout_s) with one line naming rank 3 and the environment each arrived rank saw."""
    port, run = free_port(), tmp_path / "run"
    args = [sys.executable, "-m", "gridshard", "train", "--no-progress", "--run-dir", str(run),
            "parallel.data=4", "parallel.tensor=1", "parallel.tensor_mode=none", f"train.collective_timeout_s={TIMEOUT_S}",
            "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=2"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(args, env=_worker_env(r, 4, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(3)]
    outs = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    took = time.perf_counter() - t0
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == EXIT_WORKER_ERROR, (rank, p.returncode, err)
        lines = [line for line in err.splitlines() if line.startswith("gridshard: rank")]
        assert len(lines) == 1 and "Traceback" not in err, err
        line = lines[0]
        assert line.startswith(f"gridshard: rank {rank}: rendezvous incomplete after {TIMEOUT_S} s"), line
        assert "WORLD_SIZE=4 ranks expected, 3 arrived; missing: rank 3." in line, line
        for seen in range(3):
            assert f"rank {seen}: RANK={seen} WORLD_SIZE=4 LOCAL_RANK={seen} LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 " \
                   f"MASTER_PORT={port} host=" in line, line
    assert took < TIMEOUT_S + 60, took               # start-up (imports, 3 processes on 2 cores) + the timeout


def test_a_rank_without_rank_0_says_it_cannot_reach_the_store(tmp_path):
    port = free_port()
    from gridshard.rendezvous import RendezvousError, rank0_store

    env = _worker_env(1, 2, port)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(RendezvousError, match=f"rank 1 could not reach rank 0's store at 127.0.0.1:{port} in 2 s"):
            rank0_store(2)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _train_skipping_a_gather(skipper: int, step: int):
    """Train D2 T2; rank ``skipper`` skips the world all-gather of the metrics at log step ``step``
    (its own figures stand in for everyone's) and goes on to the log step's next collective."""
    import torch
    import torch.distributed as dist

    from gridshard.comm import collectives as C
    from gridshard.engine import Trainer
    from gridshard.mesh import set_collective_timeout

    set_collective_timeout([dist.group.WORLD], TIMEOUT_S)
    cfg = {"model": {"preset": "tiny", "layers": 2}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 50_000},
           "parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d"},
           "train": {"global_batch": 8, "micro_batch": 2, "steps": 8, "log_interval": 2, "eval_interval": 0,
                     "collective_timeout_s": TIMEOUT_S}}
    trainer = Trainer(cfg, progress=False)
    set_collective_timeout(trainer.mesh.groups(), TIMEOUT_S)     # a mesh an earlier test built keeps its own
    real, skipped = C.all_gather, []

    def skipping(x, axis, dim=-1, async_op=False):
        if axis.name == "world" and trainer.ranges.step == step and not skipped:
            skipped.append(True)
            return torch.cat([x] * axis.size, dim)
        return real(x, axis, dim, async_op)

    if dist.get_rank() == skipper:
        C.all_gather = skipping
    try:
        trainer.run()
    finally:
        C.all_gather = real


def test_a_skipped_collective_names_the_call_the_group_and_the_missing_rank():
    """Rank 2 skips the metrics all-gather of log step 4. Ranks 0, 1 and 3 time out in it and name
    rank 2, which never issued that call and waits in the loss all-reduce with its data partner,
    rank 0; rank 2 times out there and names rank 0, still in the all-gather."""
    with pytest.raises(RankFailure) as failed:
        run_on_ranks(4, _train_skipping_a_gather, 2, 4, timeout=300)
    text = str(failed.value)
    messages = {}
    for line in text.splitlines():
        if "CollectiveTimeout: " in line:
            message = line.split("CollectiveTimeout: ", 1)[1]
            messages[int(message.split(" on rank ", 1)[1].split()[0].strip(":"))] = message
    assert sorted(messages) == [0, 1, 2, 3], text
    zero = messages[0]              # rank 2's wait may end first and close its connections: "broke off" on rank 0
    assert zero.startswith((f"a collective timed out after {TIMEOUT_S} s (train.collective_timeout_s) on rank 0: ",
                            "a collective broke off on rank 0 (a member closed its connection")), zero
    assert "all_gather on the world axis (ranks 0, 1, 2, 3), this rank's call #2 on that group" in zero, zero
    assert ", step 4, in gridshard.log. Did not arrive: rank 2, which never issued call #" in zero, zero
    assert "and is in all_reduce on the data axis (ranks 0, 2), its call #" in zero and zero.count("step 4, in " \
           "gridshard.log") == 2, zero
    two = messages[2]
    assert "on rank 2: all_reduce on the data axis (ranks 0, 2)" in two and "step 4, in gridshard.log" in two, two
    assert "Did not arrive: rank 0, which never issued call #" in two and "is in all_gather on the world axis " \
           "(ranks 0, 1, 2, 3), its call #2 there" in two, two


def test_a_timeout_without_peers_names_the_call_alone():
    """No store to ask (or no answer): the message still names this rank's call and place, and says
    the others are unknown; a member that never answers is named as such."""
    from gridshard.comm.ledger import CommLedger
    from gridshard.engine.hang import explain_timeout, is_collective_timeout
    from gridshard.engine.profiling import Ranges
    from gridshard.mesh import Axis

    error = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation to complete")
    assert is_collective_timeout(error) and is_collective_timeout(RuntimeError("Connection closed by peer"))
    assert not is_collective_timeout(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    ledger, ranges = CommLedger(), Ranges()
    ranges.step = 3
    with ranges("gridshard.grad_reduce"):
        ledger.enter("all_reduce", Axis("data", 2, 0, (0, 2), None))
    alone = str(explain_timeout(error, ledger, ranges, 0, 6.0))
    assert "on rank 0: all_reduce on the data axis (ranks 0, 2), this rank's call #1 on that group, step 3, in " \
           "gridshard.grad_reduce. The other members' positions are unknown" in alone, alone

    class Store:                                          # the peer never publishes
        def __init__(self):
            self.kv = {}

        def set(self, key, value):
            self.kv[key] = value.encode()

        def check(self, keys):
            return all(k in self.kv for k in keys)

        def get(self, key):
            return self.kv[key]

    store = Store()
    silent = str(explain_timeout(error, ledger, ranges, 0, 6.0, store, answer_s=0.3))
    assert "Did not arrive: rank 2, which did not answer in 0.3 s (dead, stopped, or busy outside any collective)" \
           in silent, silent
    assert json.loads(store.kv["gridshard/timeout/rank0"])["call"]["number"] == 1

