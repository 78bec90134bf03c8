"""The planner against published training runs: predicted throughput at the published layout.

For each published run below, the planner prices exactly the published layout (D, P, T,
micro-batch 1, the published recompute) on the packaged hardware profile of that GPU and
the run's own model shape, and we compare its tokens per second with the published ones:

    ratio = predicted tokens/s ÷ published tokens/s          (1.0 = the planner is right)

Published tokens/s come from the published per-GPU FLOP rate X over n GPUs and the FLOPs the
source counts per step:

* Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM*, Table 1 (A100 80 GB, fp16 mixed precision, s = 2048, V = 51200, full
  activation recompute): the paper counts F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per
  iteration (recompute included), so the iteration takes F / (n·X) and carries B·s tokens.
  Their runs predate sequence parallelism and the distributed optimizer: SP off, ZeRO 0.
  GPT's 4h GELU MLP is modelled by our SwiGLU with f = 8h/3 rounded to a multiple of T (the
  same 8h² parameters and FLOPs per layer, within 0.05 %).
* Llama 3 405B (Dubey et al. 2024, *The Llama 3 Herd of Models*, Table 4): 8192 H100s,
  TP 8, PP 16, DP 64, s = 8192, 16 M tokens per batch, 430 TFLOP/s per GPU (43 % bf16 MFU).
  The paper's MFU is model FLOPs, so published tokens/s = n·X / (our model FLOPs per token,
  :func:`gridshard.theory.training.flops_per_token`). Modelled with TP + SP, ZeRO-1
  (optimizer state sharded over data; the paper shards more, which changes memory, not the
  step), no recompute, 1F1B on the even split with one layer less on the first and last
  stage (the paper's 126-layer split).

Which schedule each Narayanan run used is not in Table 1; each row is priced with 1F1B and,
where the layers allow it, the interleaved schedule with 2 virtual stages, and both are shown.
Memory is not the question here (``evaluate(..., price_too_large=True)``): the "fits" column
says whether the planner's memory model accepts the published layout.

Run: ``python benchmarks/planner_published.py`` (about a minute; prints a Markdown table,
quoted in docs/planner.md).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gridshard.config import load_config  # noqa: E402
from gridshard.planner.hardware import load_hardware  # noqa: E402
from gridshard.planner.layouts import Layout  # noqa: E402
from gridshard.planner.search import evaluate  # noqa: E402
from gridshard.theory.training import flops_per_token  # noqa: E402

NARAYANAN = "Narayanan et al. 2021, Table 1"
LLAMA3 = "Dubey et al. 2024 (Llama 3), Table 4"


@dataclass(frozen=True)
class PublishedRun:
    source: str
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    global_batch: int
    D: int
    P: int
    T: int
    tflops_per_gpu: float
    hardware: str
    recompute: str = "full"
    sequence_parallel: bool = False
    zero: int = 0
    stage_layers: tuple = None

    @property
    def gpus(self) -> int:
        return self.D * self.P * self.T

    def overrides(self) -> list:
        return ["model.preset=null", f"model.vocab_size={self.vocab}", f"model.hidden={self.hidden}",
                f"model.layers={self.layers}", f"model.heads={self.heads}", f"model.kv_heads={self.kv_heads}",
                f"model.ffn_hidden={self.ffn}", f"model.max_seq_len={self.seq}", f"data.seq_len={self.seq}",
                f"train.global_batch={self.global_batch}", "train.precision=bf16"]

    def published_tokens_per_s(self, model_flops_per_token: float) -> float:
        X, n = self.tflops_per_gpu * 1e12, self.gpus
        if self.source == NARAYANAN:
            B, s, l, h, V = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
            flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
            return B * s / (flops / (n * X))
        return n * X / model_flops_per_token


def _gpt(name, h, l, heads, T, P, n, B, X):
    ffn = round(8 * h / 3 / T) * T                     # 8h/3, to a multiple of T (whole neurons per rank)
    return PublishedRun(NARAYANAN, name, h, l, heads, heads, ffn, 51200, 2048, B, n // (P * T), P, T, X, "a100")


RUNS = [
    _gpt("18.4B", 6144, 40, 48, 8, 1, 256, 1024, 135),
    _gpt("39.1B", 8192, 48, 64, 8, 2, 512, 1536, 138),
    _gpt("76.1B", 10240, 60, 80, 8, 4, 1024, 1792, 140),
    _gpt("145.6B", 12288, 80, 96, 8, 8, 1536, 2304, 148),
    _gpt("310.1B", 16384, 96, 128, 8, 16, 1920, 2160, 155),
    _gpt("529.6B", 20480, 105, 128, 8, 35, 2520, 2520, 163),
    _gpt("1T", 25600, 128, 160, 8, 64, 3072, 3072, 163),
    PublishedRun(LLAMA3, "405B", 16384, 126, 128, 8, 53248, 128256, 8192, 2048, 64, 16, 8, 430, "h100",
                 recompute="none", sequence_parallel=True, zero=1, stage_layers=(7,) + (8,) * 14 + (7,)),
]


def schedules(run: PublishedRun) -> list:
    """(schedule, virtual stages) to price: 1F1B, and interleaved with 2 virtual stages where every
    virtual stage gets whole layers of the default split."""
    out = [("1f1b", 1)]
    if run.P > 1 and run.stage_layers is None and run.layers % (2 * run.P) == 0:
        out.append(("interleaved_1f1b", 2))
    return out


def price(run: PublishedRun, schedule: str = "1f1b", virtual: int = 1):
    """The planner's candidate for ``run``'s published layout (priced even when it does not fit)."""
    cfg = load_config(None, run.overrides())
    layout = Layout(run.D, run.P, run.T, "1d" if run.T > 1 else "none", run.sequence_parallel, run.zero,
                    run.recompute, 1, schedule if run.P > 1 else "1f1b", virtual, run.stage_layers)
    return evaluate(cfg, layout, load_hardware(run.hardware), run.gpus, nodes=-(-run.gpus // 8),
                    price_too_large=True)


def ratio(run: PublishedRun, cand) -> float:
    """Predicted ÷ published tokens per second (module docstring)."""
    mc = load_config(None, run.overrides()).model.resolve()
    fpt = flops_per_token(mc.vocab_size, mc.hidden, mc.layers, mc.ffn_hidden, run.seq, mc.kv_heads * mc.head_dim)
    return cand.tokens_per_s / run.published_tokens_per_s(fpt)


def main() -> None:
    print("| source | model | GPUs | D P T | schedule | published TFLOP/s/GPU | predicted step s | "
          "predicted ÷ published tokens/s | fits (predicted GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        for schedule, v in schedules(run):
            c = price(run, schedule, v)
            fits = f"{'yes' if c.feasible else 'no'} ({c.predicted_mem_bytes / 2**30:.1f})"
            label = schedule + (f"/v{v}" if v > 1 else "")
            print(f"| {run.source} | {run.name} | {run.gpus} | {run.D} {run.P} {run.T} | {label} | "
                  f"{run.tflops_per_gpu:g} | {c.predicted_step_s:.2f} | {ratio(run, c):.3f} | {fits} |")


if __name__ == "__main__":
    main()
