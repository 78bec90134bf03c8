"""Activation recompute (``train.recompute``): the same training run bit for bit, fewer bytes
kept for backward, and full recompute repeating exactly the decoder layers' forward
collectives (selective repeats none)."""
import pytest
import torch
import torch.distributed as dist

from gridshard.engine import Trainer
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 3, "lr": 3e-3, "warmup_steps": 1, "log_interval": 1,
                  "seed": 5}}


def _cfg(T, mode, sp, recompute):
    return {**BASE, "parallel": {"data": 1, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp},
            "train": {**BASE["train"], "recompute": recompute}}


def _saved_bytes(trainer):
    """Bytes autograd keeps for backward over one micro-batch's forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    micro, _ = trainer.plan.step_batches(0)
    tokens, targets = (trainer.context.shard_tokens(x) for x in micro[0])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.context.model_loss(trainer.model, tokens, targets, reduction="sum")
    del loss
    return total[0]


def _body(cfg):
    trainer = Trainer(cfg, progress=False)
    saved = _saved_bytes(trainer)
    before = {k: (v.count, v.payload_bytes) for k, v in trainer.ledger.entries.items()}
    losses = trainer.run()
    ledger = {k: (v.count - before.get(k, (0, 0))[0], v.payload_bytes - before.get(k, (0, 0))[1])
              for k, v in trainer.ledger.entries.items()}
    state = gathered_state_dict(trainer.model)
    return (losses, state, saved, ledger) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("layout", [(2, "1d", True), (4, "2d", False)], ids=["T2-1d-SP", "T4-2d"])
def test_recompute_is_exact_and_saves_activations(layout):
    T, mode, sp = layout
    runs = {r: run_on_ranks(T, _body, _cfg(T, mode, sp, r), timeout=300)[0] for r in ("none", "selective", "full")}
    losses, state, saved, ledger = runs["none"]
    for r in ("selective", "full"):
        assert runs[r][0] == losses, r                               # bit for bit
        assert all(torch.equal(runs[r][1][k], state[k]) for k in state), r
    assert runs["full"][2] < runs["selective"][2] < saved, {r: v[2] for r, v in runs.items()}
    # selective recomputes no collective; full repeats the layers' forward ones (more, never fewer)
    tensor_ops = [k for k in ledger if k[1] != "world"]
    assert {k: runs["selective"][3][k] for k in tensor_ops} == {k: ledger[k] for k in tensor_ops}
    assert sum(runs["full"][3][k][1] for k in tensor_ops) > sum(ledger[k][1] for k in tensor_ops)
    if mode == "1d":                  # the layers' forward collectives up to the last saved tensor, again
        from gridshard.theory.tp1d import block_recompute_comm

        t, m = BASE["train"], BASE["model"]
        micro = t["steps"] * t["global_batch"] // t["micro_batch"]
        layers, hidden = 2, 64                                            # the tiny preset
        fwd = block_recompute_comm(t["micro_batch"], BASE["data"]["seq_len"], hidden, T, sp)
        extra = {op: (runs["full"][3][(op, "tensor")][0] - ledger[(op, "tensor")][0],
                      runs["full"][3][(op, "tensor")][1] - ledger[(op, "tensor")][1]) for op in fwd.calls}
        assert extra == {op: (micro * layers * fwd.count(op), micro * layers * fwd.payload_bytes(op))
                         for op in fwd.calls}, (extra, m)
