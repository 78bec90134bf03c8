"""Per-rank memory measured against :mod:`gridshard.theory.memory`: model state by ZeRO stage,
activations by recompute mode.

For each model (``tiny`` and a mid-size one, h=512, L=8) at D data ranks (default 4, T = 1,
gloo, fresh processes) and each requested ZeRO stage, every rank builds a
:class:`gridshard.engine.Trainer` (``train.zero`` passed through for stages > 0), runs one
optimizer step and sums the distinct storages of its parameters, their gradients and the
optimizer state (:func:`gridshard.engine.memory_meter.model_state_tensor_bytes`; a ZeRO
reducer ``trainer.reducer`` exposes its extra buffers as ``memory_tensors()``). That
is compared with :func:`gridshard.theory.memory.model_state_bytes` for the same rank.
Stages > 0 are skipped, with a message, while the trainer has no ``zero`` object (or the
config does not know ``train.zero``).

Activations: for each recompute mode the same rank's bytes saved for backward during one
micro-batch's forward (:class:`gridshard.engine.memory_meter.SavedTensorMeter`, parameters
excluded) against :func:`gridshard.theory.memory.activation_bytes`.

    .venv/bin/python benchmarks/bench_memory.py [--data 4] [--zero 0 1 2 3] [--models tiny mid]
                                                [--micro-batch 2] [--seq 128]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._runner import format_table, run_on_fresh_ranks  # noqa: E402

MODELS = {
    "tiny": {"preset": "tiny"},
    "mid": {"preset": None, "vocab_size": 4096, "hidden": 512, "layers": 8, "heads": 8, "ffn_hidden": 1376,
            "max_seq_len": 256},
}
RECOMPUTE = ("none", "selective", "full")


def _config(model: dict, data: int, zero: int, recompute: str, micro_batch: int, seq: int) -> dict:
    train = {"global_batch": micro_batch * data, "micro_batch": micro_batch, "steps": 1, "lr": 1e-3,
             "warmup_steps": 0, "precision": "fp32", "seed": 0, "log_interval": 1, "recompute": recompute}
    if zero:
        train["zero"] = zero
    return {"parallel": {"data": data, "tensor": 1, "tensor_mode": "none", "pipeline": 1},
            "model": dict(model), "data": {"kind": "stdlib", "seq_len": seq}, "train": train}


def _zero_extra(trainer):
    return list(trainer.reducer.memory_tensors())


def _model_state(model: dict, data: int, zero: int, micro_batch: int, seq: int):
    """One rank: build, one step, measured model-state bytes (or a skip message)."""
    from gridshard.engine import Trainer
    from gridshard.engine.memory_meter import model_state_tensor_bytes

    try:
        trainer = Trainer(_config(model, data, zero, "none", micro_batch, seq), run_dir=None, progress=False)
    except Exception as e:                          # noqa: BLE001 - e.g. train.zero unknown to the schema
        if zero:
            return {"skip": f"ZeRO-{zero}: the trainer does not accept train.zero yet ({type(e).__name__})"}
        raise
    trainer.step(0)
    got = model_state_tensor_bytes(trainer.model, trainer.optimizer, _zero_extra(trainer))
    return {"measured": got, "rank": trainer.mesh.data.rank}


def _activations(model: dict, data: int, micro_batch: int, seq: int):
    """One rank: saved-for-backward bytes of one micro-batch's forward per recompute mode."""
    from gridshard.engine import Trainer
    from gridshard.engine.memory_meter import SavedTensorMeter

    out = {}
    for recompute in RECOMPUTE:
        trainer = Trainer(_config(model, data, 0, recompute, micro_batch, seq), run_dir=None, progress=False)
        micro, _ = trainer.plan.step_batches(0)
        tokens, targets = micro[0]
        ctx = trainer.context
        with SavedTensorMeter(exclude=trainer.model.parameters()) as meter:
            ctx.model_loss(trainer.model, ctx.shard_tokens(tokens), ctx.shard_tokens(targets), reduction="sum")
        out[recompute] = meter.bytes
        del trainer
    return out


def _resolve(model: dict):
    from gridshard.config.schema import ModelSection

    return ModelSection(**model).resolve()


def _mib(x: int) -> str:
    return f"{x / 2**20:.3f}"


def main(argv=None) -> None:
    from gridshard.parallel.rank_blocks import rank_parameter_blocks
    from gridshard.theory import memory as M

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=int, default=4)
    ap.add_argument("--zero", type=int, nargs="+", default=[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    D = args.data
    state_rows, act_rows, notes = [], [], []
    for name in args.models:
        model = MODELS[name]
        cfg = _resolve(model)
        blocks = rank_parameter_blocks(cfg)
        for zero in args.zero:
            results = run_on_fresh_ranks(D, _model_state, model, D, zero, args.micro_batch, args.seq)
            if "skip" in results[0]:
                notes.append(f"{name}: {results[0]['skip']}")
                continue
            for r in results:
                rank = r["rank"]
                f = M.model_state_bytes(blocks, zero=zero, data=D, data_rank=rank)
                got = r["measured"]
                measured = got["params"] + got["grads"] + got["optimizer"] + got["extra"]
                formula = f.held
                state_rows.append([name, zero, rank, _mib(got["params"]), _mib(got["grads"]),
                                   _mib(got["optimizer"] + got["extra"]), _mib(measured), _mib(formula),
                                   f"{measured / formula - 1:+.2%}"])
        acts = run_on_fresh_ranks(D, _activations, model, D, args.micro_batch, args.seq)[0]
        for recompute in RECOMPUTE:
            f = M.activation_bytes(cfg, args.micro_batch, args.seq, recompute=recompute).total
            act_rows.append([name, recompute, _mib(acts[recompute]), _mib(f), f"{acts[recompute] / f - 1:+.2%}"])
    print(f"# memory per rank, D={D}, T=1, fp32, micro-batch {args.micro_batch} × seq {args.seq}; "
          f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs")
    if state_rows:
        print("\nmodel state after one optimizer step (MiB)")
        print(format_table(["model", "zero", "rank", "params", "grads", "optimizer + ZeRO buffers", "measured",
                            "formula", "diff"], state_rows))
        print("ZeRO buffers: the flat row shards of ZeRO-3 (its parameters' storage is released between uses) "
              "and the reduced gradient segments of ZeRO 1-3 (the shards' gradients are views into them)")
    for note in notes:
        print(f"skipped: {note}")
    print("\nactivations saved for backward, one micro-batch, rank 0 (MiB)")
    print(format_table(["model", "recompute", "measured", "formula", "diff"], act_rows))


if __name__ == "__main__":
    main()
