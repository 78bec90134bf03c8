"""What a document mask costs attention, and which kernel takes it best here.

Attention forward + backward on q [b, H, s, d], k/v [b, H_kv, s, d] (grouped-query heads, fp32 and
bf16), each packed window holding documents of ``--doc`` tokens on average (random lengths), one
thread. Rows take turns round by round, so machine noise hits all alike; medians and ratios to the
first row:

* *causal*: ``F.scaled_dot_product_attention(is_causal=True)``: the window as one document (what
  ``data.document_mask: false`` runs);
* *SDPA + bool mask*: the same call with the document-causal boolean mask
  (:func:`gridshard.nn.documents.attention_mask`): what gridshard runs;
* *flex_attention* (eager) and, with ``--compile``, *flex_attention compiled*: torch's
  ``torch.nn.attention.flex_attention`` with the same mask as a block mask (``create_block_mask``,
  built once per window as gridshard builds its mask once per micro-batch).

Every row's output is checked against the SDPA + mask row (max abs difference printed).

    .venv/bin/python benchmarks/bench_document_mask.py [--seq 1024 2048] [--doc 128] [--rounds 7] [--compile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gridshard.nn.documents import attention_mask  # noqa: E402


def _documents(b: int, s: int, mean: int, g: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(b):
        cuts = torch.randint(1, 2 * mean, (s,), generator=g).cumsum(0)
        ends = torch.zeros(s, dtype=torch.long)
        ends[cuts[cuts < s]] = 1
        rows.append(ends.cumsum(0))
    return torch.stack(rows)


def _rows(docs, q, compile_flex: bool) -> dict:
    mask = attention_mask(docs, docs)
    rows = {"causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "SDPA + bool mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                               enable_gqa=True)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return rows

    def doc_causal(b, h, qi, ki):
        return (docs[b, qi] == docs[b, ki]) & (ki <= qi)

    s = q.shape[2]
    block = create_block_mask(doc_causal, docs.shape[0], None, s, s, device="cpu")
    rows["flex_attention"] = lambda q, k, v: flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    if compile_flex:
        compiled = torch.compile(flex_attention)
        rows["flex_attention compiled"] = lambda q, k, v: compiled(q, k, v, block_mask=block, enable_gqa=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--doc", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for s in a.seq:
            q = torch.randn(a.batch, a.heads, s, a.head_dim, generator=g).to(dtype).requires_grad_()
            k, v = (torch.randn(a.batch, a.kv_heads, s, a.head_dim, generator=g).to(dtype).requires_grad_()
                    for _ in range(2))
            docs = _documents(a.batch, s, a.doc, g)
            rows = _rows(docs, q, a.compile)
            qf, kf, vf = (t.detach() for t in (q, k, v))
            with torch.no_grad():
                ref = rows["SDPA + bool mask"](qf, kf, vf).float()
                diffs = {name: float((fn(qf, kf, vf).float() - ref).abs().max()) for name, fn in rows.items()}
            fwd, both = {name: [] for name in rows}, {name: [] for name in rows}
            for _ in range(a.rounds):
                for name, fn in rows.items():
                    with torch.no_grad():
                        t0 = time.perf_counter()
                        fn(qf, kf, vf)
                        fwd[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    try:
                        fn(q, k, v).sum().backward()
                        both[name].append(time.perf_counter() - t0)
                    except NotImplementedError:            # flex_attention has no CPU backward
                        pass
            print(f"\n{str(dtype)[6:]} s={s} b={a.batch} H={a.heads} H_kv={a.kv_heads} d={a.head_dim}, documents of "
                  f"~{a.doc} tokens ({int(docs[:, -1].max()) + 1} in the window), median of {a.rounds}:")
            base_f, base_b = statistics.median(fwd["causal"]), statistics.median(both["causal"])
            for name in rows:
                f = statistics.median(fwd[name])
                b = f"{statistics.median(both[name]) * 1e3:9.1f} ms ×{statistics.median(both[name]) / base_b:5.2f}" \
                    if both[name] else f"{'no backward on ' + q.device.type:>18s}"
                note = "" if name == "causal" else f"  max |Δ| vs SDPA+mask {diffs[name]:.1e}"
                print(f"  {name:26s} fwd {f * 1e3:9.1f} ms ×{f / base_f:5.2f}   fwd+bwd {b}{note}")


if __name__ == "__main__":
    main()
