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
  :func:`gridshard.theory.training.flops_per_token`). Modelled with TP + SP, ZeRO-2 (the
  paper's FSDP shards optimizer state and gradients over data, parameters stay whole between
  forward and backward), no recompute (the paper: "without activation checkpointing"), 1F1B
  on the even split with one layer less on the first and last stage (the paper's 126-layer
  split; its interleaved schedule holds more micro-batches, not fewer), and once more with
  our ``selective`` recompute, whose saved bytes are the paper's accounting less the norm
  outputs and the SwiGLU product, which it rebuilds in backward (``--breakdown``).

Which schedule each Narayanan run used is not in Table 1; each row is priced with 1F1B and,
where the layers allow it, the interleaved schedule with 2 virtual stages, and both are shown.
Memory is not the question here (``evaluate(..., price_too_large=True)``): the "fits" column
says whether the planner's memory model accepts the published layout.

Run: ``python benchmarks/planner_published.py`` (about a minute; prints a Markdown table,
quoted in docs/planner.md); ``--breakdown``: the 405B rank's predicted bytes term by term next
to the published accounting (:func:`breakdown`, also quoted there); ``--fig13``: Narayanan et al.
2021's Fig. 13 (t, p) sweep on 64 A100 (:func:`fig13`; issue 43,
``tests/test_planner_published_ranking.py``).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gridshard.config import load_config  # noqa: E402
from gridshard.planner.hardware import load_hardware  # noqa: E402
from gridshard.planner.layouts import Layout, overlap_choices  # noqa: E402
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
                 recompute="none", sequence_parallel=True, zero=2, stage_layers=(7,) + (8,) * 14 + (7,)),
    PublishedRun(LLAMA3, "405B, selective", 16384, 126, 128, 8, 53248, 128256, 8192, 2048, 64, 16, 8, 430, "h100",
                 recompute="selective", sequence_parallel=True, zero=2, stage_layers=(7,) + (8,) * 14 + (7,)),
]


def schedules(run: PublishedRun) -> list:
    """(schedule, virtual stages) to price: 1F1B, and interleaved with 2 virtual stages where every
    virtual stage gets whole layers of the default split."""
    out = [("1f1b", 1)]
    if run.P > 1 and run.stage_layers is None and run.layers % (2 * run.P) == 0:
        out.append(("interleaved_1f1b", 2))
    return out


def price(run: PublishedRun, schedule: str = "1f1b", virtual: int = 1, overlap_grad_reduce: bool = True):
    """The planner's candidate for ``run``'s published layout (priced even when it does not fit);
    ``overlap_grad_reduce`` False: whole-gradient accumulation (``train.overlap_grad_reduce: false``)."""
    cfg = load_config(None, run.overrides())
    layout = Layout(run.D, run.P, run.T, "1d" if run.T > 1 else "none", run.sequence_parallel, run.zero,
                    run.recompute, 1, schedule if run.P > 1 else "1f1b", virtual, run.stage_layers,
                    overlap_grad_reduce=overlap_grad_reduce)
    return evaluate(cfg, layout, load_hardware(run.hardware), run.gpus, nodes=-(-run.gpus // 8),
                    price_too_large=True)


def ratio(run: PublishedRun, cand) -> float:
    """Predicted ÷ published tokens per second (module docstring)."""
    mc = load_config(None, run.overrides()).model.resolve()
    fpt = flops_per_token(mc.vocab_size, mc.hidden, mc.layers, mc.ffn_hidden, run.seq, mc.kv_heads * mc.head_dim)
    return cand.tokens_per_s / run.published_tokens_per_s(fpt)


GIB = 2 ** 30


def published_layer_tensors(mc, T: int, tokens: int, e: int = 2) -> dict:
    """Korthikanti et al. 2022's activation accounting (Sec. 4.1: every op keeps the inputs its
    backward reads, TP + SP, e-byte activations) applied to a Llama block as Megatron runs it:
    flash attention (no s×s scores, its fp32 log-sum-exp instead), no dropout, SwiGLU fused as
    Megatron's ``bias_swiglu`` (keeps the fc1 output g|u and its product, recomputes silu(g)),
    norm input and output (a sequence block under SP). Name → bytes per rank, our names
    (:func:`gridshard.theory.memory.layer_saved_tensors`) where the tensor is the same."""
    block, f = tokens * mc.hidden // T * e, tokens * mc.ffn_hidden // T * e
    kv = tokens * max(mc.kv_heads // T, 1) * mc.head_dim * e
    norm = 2 * block                                     # input, and output (the next matmul's input)
    return {"attn_norm (x, rstd, y)": norm, "q": block, "k": kv, "v": kv, "attention output": block,
            "lse": tokens * mc.heads // T * 4, "mlp_norm (x, rstd, y)": norm, "gate g": f, "up u": f,
            "silu(g)·u": f}


def _state_terms(mc, run: PublishedRun, rank: int, counts: list) -> dict:
    """Model state of pipeline rank ``rank`` by term (bf16 storage, ZeRO ``run.zero`` over D):
    bf16 parameters, fp32 masters, gradients, Adam moments (+ step counters), ZeRO-1's reduced chunk."""
    from gridshard.planner.memo import rank_blocks
    from gridshard.theory.memory import model_state_bytes, zero_units
    from gridshard.theory.zero import unit_padded_numel

    ids = [i for i in range(sum(counts[:rank]), sum(counts[:rank + 1]))]
    blocks = rank_blocks(mc, "1d", run.T, ids, rank == 0, rank == run.P - 1)
    st = model_state_bytes(blocks, run.zero, run.D, 0, param_bytes=2)
    padded = sum(unit_padded_numel([b.numel for b in bs], run.D) for bs in zero_units(blocks).values())
    masters = 4 * padded // run.D if run.zero else 4 * padded
    return {"params (bf16)": st.params - masters, "fp32 masters": masters, "grads": st.grads,
            "Adam moments + step counters": st.optimizer, "ZeRO-1 reduced chunk": st.comm_buffers,
            "Ψ (rank parameters)": sum(b.numel for b in blocks)}


def breakdown(run: PublishedRun = None) -> None:
    """Term by term: what the planner predicts for ``run`` (the Llama 3 405B recipe by default) at
    recompute none and selective, next to the published accounting (docs/planner.md, "Llama 3
    405B")."""
    from gridshard.theory.memory import layer_saved_tensors

    run = run or next(r for r in RUNS if r.source == LLAMA3)
    mc = load_config(None, run.overrides()).model.resolve()
    N = run.seq
    ours = {rc: layer_saved_tensors(mc, "1d", run.T, True, N, rc, e=2) for rc in ("none", "selective")}
    pub = published_layer_tensors(mc, run.T, N)
    print(f"### {run.name}: one decoder layer's saved activations per rank (MB), b 1, s {N}, T {run.T} + SP, bf16\n")
    print("| tensor | ours, none | ours, selective | published accounting |\n|---|---|---|---|")
    for k in dict.fromkeys([*ours["none"], *ours["selective"], *pub]):
        cells = [f"{d[k] / 1e6:.1f}" if k in d else "–" for d in (ours["none"], ours["selective"], pub)]
        print(f"| {k} | " + " | ".join(cells) + " |")
    tot = [sum(d.values()) for d in (ours["none"], ours["selective"], pub)]
    print("| **per layer** | " + " | ".join(f"**{t / 1e6:.1f}**" for t in tot) + " |")
    print("| ÷ (s·b·h/T bytes, Korthikanti's unit; GPT: 34) | "
          + " | ".join(f"{t / (N * mc.hidden / run.T):.1f}" for t in tot) + " |\n")
    for rc in ("none", "selective"):
        _rank_table(run, mc, rc, sum(pub.values()))


def _rank_rows(run: PublishedRun, mc, rank: int, m, counts: list) -> tuple:
    """(rows of (term, bytes) adding up to ``m.total_with_margin``, Ψ) of pipeline rank ``rank``."""
    from gridshard.theory.memory import activation_bytes

    layers = counts[rank] if counts else mc.layers // run.P
    first, last, k = rank == 0, rank == run.P - 1, m.details["in_flight"]
    acts = activation_bytes(mc, 1, run.seq, "1d", run.T, run.sequence_parallel, m.details.get("recompute", "none"),
                            layers, first, last, "bf16", param_bytes=2)
    st = _state_terms(mc, run, rank, counts)
    psi = st.pop("Ψ (rank parameters)")
    rows = [*st.items(), ("micro-batches in flight × decoder layers", None),
            ("activations: decoder layers", k * acts.decoder), ("activations: embedding (ids, masks)", k * acts.embedding),
            ("activations: final norm, head, loss (fp32 softmax)", k * (acts.final_norm + acts.head_and_loss)),
            ("activations held once (RoPE tables)", acts.held_once),
            ("logits workspace (bf16 logits + fp32 upcast)", m.details["logits_workspace"]),
            ("pipeline stage buffers (in-flight outputs kept, one output gradient received)",
             m.details["stage_buffers"]),
            ("backward transient (ZeRO gradient buffers, gathers)", m.transient),
            ("reserved (hardware file)", m.baseline), (f"margin ({m.margin_fraction:.0%} of activations, buffers, transients)", m.margin)]
    assert sum(v for _, v in rows if v is not None) == m.total_with_margin, "the rows are every term"
    return [(t, f"{k} × {layers}" if v is None else v) for t, v in rows], psi, layers


def _rank_table(run: PublishedRun, mc, recompute: str, pub_layer: int) -> None:
    """Every priced pipeline rank's predicted bytes by term (GiB), with the published accounting of
    the busiest."""
    import dataclasses

    from gridshard.planner.cost_memory import rank_memories

    r2 = dataclasses.replace(run, recompute=recompute)
    c, hw = price(r2), load_hardware(run.hardware)
    cfg = load_config(None, r2.overrides())
    layout = c.layout
    mems = rank_memories(mc, layout, run.seq, run.global_batch, hw.reserved_bytes, hw.margin_fraction, "bf16")
    counts = list(run.stage_layers or [])
    for m in mems.values():
        m.details["recompute"] = recompute
    table = {r: _rank_rows(r2, mc, r, m, counts) for r, m in mems.items()}
    print(f"### recompute {recompute}, ZeRO-{run.zero}, A = {cfg.train.global_batch // run.D} micro-batches: "
          f"the ranks the planner prices (GiB; worst: rank {c.memory_rank})\n")
    print("| term | " + " | ".join(f"rank {r}" for r in table) + " |\n|---|" + "---|" * len(table))
    names = [t for t, _ in table[c.memory_rank][0]]
    for i, name in enumerate(names):
        cells = [v if isinstance(v, str) else f"{v / GIB:.2f}" for v in (table[r][0][i][1] for r in table)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"| **total with margin** (device {hw.device_memory_bytes / GIB:.2f}) | "
          + " | ".join(f"**{m.total_with_margin / GIB:.2f}**" for m in mems.values()) + " |")
    _, psi, layers = table[c.memory_rank]
    k = mems[c.memory_rank].details["in_flight"]
    published_state = 2 * psi + 14 * psi // run.D if run.zero >= 2 else 4 * psi + 12 * psi // run.D
    pub_acts = k * layers * pub_layer
    print(f"\npublished accounting for rank {c.memory_rank}: model state (ZeRO paper, Ψ = {psi / 1e9:.2f} B) "
          f"{published_state / GIB:.2f} GiB + activations {k} × {layers} × {pub_layer / 1e6:.0f} MB = "
          f"{pub_acts / GIB:.2f} GiB → {(published_state + pub_acts) / GIB:.2f} GiB, nothing reserved, no margin\n")


FIG13 = [(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)]          # (t, p) of Narayanan et al. 2021, Fig. 13


def fig13_step(t: int, p: int, batch: int, hidden: int = 20480, layers: int = 32, heads: int = 128,
               name: str = "162.2B (Fig. 13's model)") -> float:
    """The predicted step seconds of one (t, p) of the Fig. 13 sweep (:func:`fig13`): GPT's 4h GELU MLP
    as a SwiGLU of f = 8h/3 (a multiple of t), vocabulary 51200, sequence 2048, micro-batch 1, D = 1."""
    run = PublishedRun(NARAYANAN, name, hidden, layers, heads, heads, round(8 * hidden / 3 / t) * t, 51200, 2048,
                       batch, 1, p, t, 0.0, "a100")
    return price(run).predicted_step_s


def fig13(shapes=(("162.2B (Fig. 13's model)", 20480, 32, 128), ("GPT-3 175B shape", 12288, 96, 96)),
          batches=(128, 32)) -> None:
    """Narayanan et al. 2021, Fig. 13: the (t, p) sweep on 64 A100 (8 nodes) under 2021's rules (full
    recompute, no SP, ZeRO-0, 1F1B, micro-batch 1), at the figure's batch sizes, on its model (Megatron-LM's
    ``examples/sc21/run_figure_13.sh``: 32 layers, h 20480, 128 heads) and on the GPT-3 175B shape; predicted
    step seconds, fastest marked. Measured: (8, 8) the fastest at both batch sizes."""
    print("| model | batch | " + " | ".join(f"T{t} P{p}" for t, p in FIG13) + " | predicted order |")
    print("|---|---|" + "---|" * len(FIG13) + "---|")
    for name, h, layers, heads in shapes:
        for B in batches:
            step = {(t, p): fig13_step(t, p, B, h, layers, heads, name) for t, p in FIG13}
            best = min(step, key=step.get)
            cells = [f"**{v:.2f}**" if k == best else f"{v:.2f}" for k, v in step.items()]
            order = " < ".join(f"T{t}P{p}" for t, p in sorted(step, key=step.get))
            print(f"| {name} | {B} | " + " | ".join(cells) + f" | {order} |")


def main() -> None:
    if "--breakdown" in sys.argv[1:]:
        breakdown()
        return
    if "--fig13" in sys.argv[1:]:
        fig13()
        return
    print("| source | model | GPUs | D P T | schedule | published TFLOP/s/GPU | predicted step s | "
          "predicted ÷ published tokens/s | fits (predicted GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        for schedule, v in schedules(run):
            A = run.global_batch // run.D                  # micro-batch 1
            for ov in overlap_choices(run.zero, run.D, run.P, schedule, A):     # the planner's both, where both
                _row(run, price(run, schedule, v, ov), schedule + (f"/v{v}" if v > 1 else "") +
                     ("" if ov else " whole-grad"))


def _row(run: PublishedRun, c, label: str) -> None:
    """One Markdown row of :func:`main`'s table."""
    fits = f"{'yes' if c.feasible else 'no'} ({c.predicted_mem_bytes / 2**30:.1f})"
    print(f"| {run.source} | {run.name} | {run.gpus} | {run.D} {run.P} {run.T} | {label} | "
          f"{run.tflops_per_gpu:g} | {c.predicted_step_s:.2f} | {ratio(run, c):.3f} | {fits} |")


if __name__ == "__main__":
    main()
