"""Overhead of gridshard's training step at T = 1, D = 1 against a plain PyTorch loop.

Both sides train the same model (the plain ``gridshard.models.Transformer``; the plain
loop's copy loads the trainer's initial ``state_dict``, so the same initial weights) on
the same batches (``BatchPlan`` over the stdlib
corpus, built inside the timed step on both sides) with AdamW, the same warm-up + cosine
learning rate and global-norm clipping at 1.0:

* gridshard: ``Trainer.step(k)`` — micro-batch loop, data-parallel sync (a no-op at
  D = 1), global norm through the shard-spec ownership rule and a recorded
  all-reduce (no-op at T = 1), clipping, AdamW, with ``LEDGER.timing`` on as in
  training;
* plain: ``opt.zero_grad(); F.cross_entropy(model(x)…).backward();
  clip_grad_norm_(…); opt.step()`` — what a user writes by hand.

The two run in one process, step by step alternately (gridshard step k, then plain
step k), for ``repeats`` rounds of ``steps`` steps (the first ``warmup`` of a round
untimed). A round's figure is each side's median step time; the table shows the
median over rounds of each, and the overhead as the median over rounds of the paired
ratio gridshard/plain − 1 (pairing cancels most of the load swings of a shared
machine). One thread, fp32.

    .venv/bin/python benchmarks/bench_train_overhead.py [--steps 12 --warmup 3 --repeats 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gridshard.comm.ledger import LEDGER  # noqa: E402
from gridshard.engine import Trainer  # noqa: E402
from gridshard.schedule import lr_at  # noqa: E402
from gridshard.mesh import init_distributed  # noqa: E402
from gridshard.models import Transformer  # noqa: E402

MODELS = {
    "tiny": {"preset": "tiny"},
    "small": {"preset": None, "vocab_size": 256, "hidden": 256, "layers": 4, "heads": 8, "ffn_hidden": 704,
              "max_seq_len": 128},
}


def config(model: dict, steps: int) -> dict:
    return {"parallel": {"data": 1, "tensor": 1, "tensor_mode": "none"}, "model": model,
            "data": {"kind": "stdlib", "seq_len": 128, "max_bytes": 1 << 20},
            "train": {"global_batch": 8, "micro_batch": 8, "steps": steps, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1, "log_interval": steps}}


class PlainLoop:
    """The hand-written loop (module docstring), fed by the trainer's own batch plan; its
    model is a plain ``Transformer`` holding the trainer's initial weights (T = 1: the
    laid-out model's state_dict is the plain one)."""

    def __init__(self, trainer: Trainer):
        t = trainer.cfg.train
        self.t, self.plan, self.decay = t, trainer.plan, trainer.decay_steps
        self.model = Transformer(trainer.model_cfg)
        self.model.load_state_dict({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                     eps=t.adam_eps, weight_decay=t.weight_decay)

    def step(self, k: int) -> torch.Tensor:
        t = self.t
        for g in self.opt.param_groups:
            g["lr"] = lr_at(k, t.lr, t.min_lr, t.warmup_steps, self.decay, t.schedule)
        self.opt.zero_grad(set_to_none=True)
        (x, y), = self.plan.micro_batches(k)
        loss = F.cross_entropy(self.model(x).reshape(-1, self.model.cfg.vocab_size), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        return loss.detach()


def interleaved_round(gs_step, plain_step, steps: int, warmup: int):
    """Alternate one gridshard step and one plain step (so load bursts on a shared machine
    hit both alike); returns (median gridshard s, median plain s, losses of each)."""
    times, losses = ([], []), ([], [])
    for k in range(steps):
        for side, fn in enumerate((gs_step, plain_step)):
            t0 = time.perf_counter()
            loss = fn(k)
            dt = time.perf_counter() - t0
            losses[side].append(float(loss))
            if k >= warmup:
                times[side].append(dt)
    return statistics.median(times[0]), statistics.median(times[1]), losses[0], losses[1]


def bench(name: str, steps: int, warmup: int, repeats: int) -> dict:
    gs_med, plain_med = [], []
    for _ in range(repeats):
        trainer = Trainer(config(MODELS[name], steps), progress=False)
        plain = PlainLoop(trainer)
        LEDGER.timing = True
        g, p, g_loss, p_loss = interleaved_round(lambda k: trainer.step(k)[0], plain.step, steps, warmup)
        LEDGER.timing = False
        gs_med.append(g)
        plain_med.append(p)
    g, p = statistics.median(gs_med), statistics.median(plain_med)
    return {"model": name, "params": trainer.model_cfg.num_parameters(), "gridshard_ms": g * 1e3,
            "plain_ms": p * 1e3, "overhead": statistics.median(a / b for a, b in zip(gs_med, plain_med)) - 1, "loss_gs": (g_loss[0], g_loss[-1]),
            "loss_plain": (p_loss[0], p_loss[-1]), "rounds_gs": gs_med, "rounds_plain": plain_med}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="tiny,small")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores visible, 1 thread; steps={args.steps} warmup={args.warmup} repeats={args.repeats}")
    header = f"| {'model':<6} | {'params':>8} | {'gridshard ms/step':>17} | {'plain ms/step':>13} | {'overhead':>8} |"
    rows = []
    for name in args.models.split(","):
        r = bench(name, args.steps, args.warmup, args.repeats)
        rows.append(f"| {r['model']:<6} | {r['params'] / 1e6:>7.2f}M | {r['gridshard_ms']:>17.2f} | "
                    f"{r['plain_ms']:>13.2f} | {r['overhead']:>+8.1%} |")
        print(f"# {name}: per-round medians gridshard {[round(x * 1e3, 2) for x in r['rounds_gs']]} ms, "
              f"plain {[round(x * 1e3, 2) for x in r['rounds_plain']]} ms; loss gridshard "
              f"{r['loss_gs'][0]:.4f}->{r['loss_gs'][1]:.4f}, plain {r['loss_plain'][0]:.4f}->{r['loss_plain'][1]:.4f}")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
