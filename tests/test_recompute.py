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
        from gridshard.tensor.tp1d.theory import block_recompute_comm

        t, m = BASE["train"], BASE["model"]
        micro = t["steps"] * t["global_batch"] // t["micro_batch"]
        layers, hidden = 2, 64                                            # the tiny preset
        fwd = block_recompute_comm(t["micro_batch"], BASE["data"]["seq_len"], hidden, T, sp)
        extra = {op: (runs["full"][3][(op, "tensor")][0] - ledger[(op, "tensor")][0],
                      runs["full"][3][(op, "tensor")][1] - ledger[(op, "tensor")][1]) for op in fwd.calls}
        assert extra == {op: (micro * layers * fwd.count(op), micro * layers * fwd.payload_bytes(op))
                         for op in fwd.calls}, (extra, m)


def _dp_cfg(D, T, mode, sp, zero, precision, recompute):
    cfg = _cfg(T, mode, sp, recompute)
    return {**cfg, "parallel": {**cfg["parallel"], "data": D},
            "train": {**cfg["train"], "zero": zero, "precision": precision, "micro_batch": 1}}


@pytest.mark.wide
@pytest.mark.parametrize("layout", [(4, 1, "none", False, 3, "bf16"), (2, 2, "1d", True, 1, "fp32")],
                         ids=["D4-T1-zero3-bf16", "D2-T2-1d-SP-zero1"])
def test_selective_is_exact_with_data_parallel_and_zero(layout):
    """Selective (rebuilt norm outputs and silu(g)·u included) against none, bit for bit, with
    data parallelism and ZeRO (ZeRO-3: the norm weight in the recipe is the gathered parameter)
    and under bf16 autocast (the rebuild replays the forward's ops and dtypes)."""
    runs = {r: run_on_ranks(layout[0] * layout[1], _body, _dp_cfg(*layout, r), timeout=300)[0]
            for r in ("none", "selective")}
    assert runs["selective"][0] == runs["none"][0]
    assert all(torch.equal(runs["selective"][1][k], v) for k, v in runs["none"][1].items())
    assert runs["selective"][2] < runs["none"][2]


def _losses_and_state(cfg):
    trainer = Trainer(cfg, progress=False)
    losses = trainer.run()
    state = gathered_state_dict(trainer.model)
    return losses, state


@pytest.mark.wide
def test_selective_is_exact_on_pipeline_stages():
    """P = 2 (one decoder layer per stage, 1F1B, bf16): selective's rebuilt tensors inside the stages
    (the stage meter's hooks outside them) give the run without recompute bit for bit."""
    cfg = {r: _dp_cfg(1, 1, "none", False, 0, "bf16", r) for r in ("none", "selective")}
    for c in cfg.values():
        c["parallel"]["pipeline"] = 2
        c["train"]["micro_batch"] = 1
    runs = {r: run_on_ranks(2, _losses_and_state, c, timeout=300) for r, c in cfg.items()}
    for rank in range(2):
        assert runs["selective"][rank][0] == runs["none"][rank][0]
        assert all(torch.equal(runs["selective"][rank][1][k], v) for k, v in runs["none"][rank][1].items())
