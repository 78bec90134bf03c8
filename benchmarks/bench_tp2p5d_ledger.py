"""2.5D (Tesseract) layers at the layer level: what each one moves and stores per rank, from
the ledger, next to the same layers at d = 1 (2D SUMMA on one q×q grid), on CPU/gloo.

For each (q, d) (default (2, 1) on 4 ranks and (2, 2) on 8) and each layer, one forward +
backward on the same global batch of b sequences of s tokens (fp32, fresh weights from one
seed, no GatheredVectors window):

* ``linear``: Linear h → f with bias; ``mlp``: Linear h → f, GELU, Linear f → h (biases);
* ``rmsnorm``: RMSNorm h; ``embedding``: VocabParallelEmbedding V × h;
* ``head+loss``: VocabParallelClassifier h → V and cross_entropy (mean, a few targets masked).

Columns: calls per ledger axis (row / col / depth / depth_col), payload and ring wire KiB per
rank (the ledger's own figures), ``= theory`` (the ledger equals :mod:`gridshard.theory.tp2p5d`
call for call and byte for byte), parameter KiB per rank, saved-for-backward KiB per rank
(``saved_tensors_hooks``, parameters excluded) and the largest relative error of the output
and the gradients against one process on the same global weights.

    .venv/bin/python benchmarks/bench_tp2p5d_ledger.py [--b 8 --s 16 --h 64 --f 256 --vocab 509]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AXES = ("row", "col", "depth", "depth_col")


def _layers(mesh, a):
    """(name, parallel module, plain module, input kind) for one shape, built from one seed each."""
    import torch
    from torch import nn

    from gridshard.nn.embedding_2p5d import VocabParallelEmbedding2p5D
    from gridshard.nn.linear_2p5d import Linear2p5D, VocabParallelClassifier2p5D
    from gridshard.nn.norm_2p5d import RMSNorm2p5D
    from gridshard.testing.plain import plain_embedding, plain_lm_head, plain_linear

    def pair(make_par, make_ref):
        torch.manual_seed(7)
        par = make_par()
        torch.manual_seed(7)
        return par, make_ref()

    return [
        ("linear", *pair(lambda: Linear2p5D(a.h, a.f, mesh, init_std=0.05), lambda: plain_linear(a.h, a.f, True, 0.05)),
         "x"),
        ("mlp", *pair(lambda: nn.Sequential(Linear2p5D(a.h, a.f, mesh, init_std=0.05), nn.GELU(),
                                            Linear2p5D(a.f, a.h, mesh, init_std=0.05)),
                      lambda: nn.Sequential(plain_linear(a.h, a.f, True, 0.05), nn.GELU(),
                                            plain_linear(a.f, a.h, True, 0.05))), "x"),
        ("rmsnorm", *pair(lambda: RMSNorm2p5D(a.h, mesh), lambda: nn.RMSNorm(a.h, eps=1e-5)), "x"),
        ("embedding", *pair(lambda: VocabParallelEmbedding2p5D(a.vocab, a.h, mesh, 0.05),
                            lambda: plain_embedding(a.vocab, a.h, 0.05)), "tokens"),
        ("head+loss", *pair(lambda: VocabParallelClassifier2p5D(a.h, a.vocab, mesh, init_std=0.05),
                            lambda: plain_lm_head(a.h, a.vocab, 0.05)), "loss"),
    ]


def _theory(name, q, d, a):
    from gridshard.theory import tp2p5d as T

    n = a.b * a.s
    return {"linear": lambda: T.linear2p5d_comm(n, a.h, a.f, q, d, bias=True),
            "mlp": lambda: T.combine(T.linear2p5d_comm(n, a.h, a.f, q, d, bias=True),
                                     T.linear2p5d_comm(n, a.f, a.h, q, d, bias=True)),
            "rmsnorm": lambda: T.rmsnorm2p5d_comm(n, a.h, q, d),
            "embedding": lambda: T.embedding2p5d_comm(a.b, a.s, a.h, a.vocab, q, d),
            "head+loss": lambda: T.combine(T.head2p5d_comm(n, a.h, a.vocab, q, d), T.cross_entropy2p5d_comm(n, q, d)),
            }[name]()


def _run_one(mesh, par, ref, kind, a):
    """Forward + backward of both; returns (largest relative error, saved bytes of the parallel one)."""
    import torch
    import torch.nn.functional as F

    from gridshard.nn.cross_entropy_2p5d import cross_entropy_2p5d
    from gridshard.nn.sharding import shard_from_global
    from gridshard.testing.compare import relative_error
    from gridshard.testing.inputs import randint, randn

    blk = lambda t, hidden=True: mesh.batch_block(t.detach(), hidden=hidden).clone(  # noqa: E731
        memory_format=torch.contiguous_format)
    if kind == "tokens":
        X = randint(a.vocab, (a.b, a.s), 3)
        x = blk(X, hidden=False)
    else:
        X = randn((a.b, a.s, a.h), 3).requires_grad_()
        x = blk(X).requires_grad_()
    saved, y = _saved_bytes(par, lambda: par(x))
    Y = ref(X)
    if kind == "loss":
        targets = randint(a.vocab, (a.b, a.s), 4)
        targets[0, :3] = -100
        F.cross_entropy(Y.reshape(-1, a.vocab), targets.reshape(-1)).backward()
        y = cross_entropy_2p5d(y, blk(targets, hidden=False), mesh, a.vocab)
        y.backward()
        errs = [relative_error(y, F.cross_entropy(Y.detach().reshape(-1, a.vocab), targets.reshape(-1)))]
    else:
        G = randn(Y.shape, 5)
        Y.backward(G)
        y.backward(blk(G))
        errs = [relative_error(y, blk(Y))]
    if kind != "tokens":
        errs.append(relative_error(x.grad, blk(X.grad)))
    refs = dict(ref.named_parameters())
    for name, p in par.named_parameters():      # the canonical gradient laid out as the parameter is
        errs.append(relative_error(p.grad, shard_from_global(p.shard_spec.from_canonical(refs[name].grad),
                                                             p.shard_spec, mesh.grid)))
    return max(errs), saved


def _saved_bytes(module, fn):
    """(bytes of the distinct storages autograd saves inside ``fn()``, parameters excluded; its result)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _measure(q, d, a):
    from gridshard.comm import LEDGER
    from gridshard.comm.mesh_2p5d import build_mesh_2p5d

    mesh = build_mesh_2p5d(q, d)
    rows = []
    for name, par, ref, kind in _layers(mesh, a):
        LEDGER.reset()
        err, saved = _run_one(mesh, par, ref, kind, a)
        seen = {k: (e.count, e.payload_bytes, e.wire_bytes) for k, e in LEDGER.entries.items() if e.count}
        theory = _theory(name, q, d, a)
        expect = {(op, ax): (v.calls[op], v.payload[op]) for ax, v in theory.items() for op in v.calls}
        calls = {ax: sum(c for (op, x), (c, _, _) in seen.items() if x == ax) for ax in AXES}
        rows.append(dict(layer=name, q=q, d=d, T=q * q * d, calls=calls,
                         payload=sum(p for _, p, _ in seen.values()), wire=sum(w for _, _, w in seen.values()),
                         theory={k: v[:2] for k, v in seen.items()} == expect,
                         params=sum(p.numel() * p.element_size() for p in par.parameters()), saved=saved, err=err))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", type=int, default=8)
    p.add_argument("--s", type=int, default=16)
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--f", type=int, default=256)
    p.add_argument("--vocab", type=int, default=509)
    p.add_argument("--shapes", default="2x1,2x2", help="q×d pairs, comma separated")
    a = p.parse_args(argv)
    from benchmarks import bench_tp2p5d_ledger as me     # by module name: the workers import it
    from gridshard.testing import run_on_ranks, shutdown_all

    rows = []
    for qd in a.shapes.split(","):
        q, d = (int(v) for v in qd.split("x"))
        rows += run_on_ranks(q * q * d, me._measure, q, d, a, timeout=600)[0]
    shutdown_all()
    print(f"2.5D layers, fp32 CPU/gloo, b={a.b} s={a.s} h={a.h} f={a.f} V={a.vocab}; one forward + backward, per rank")
    print("| layer | q | d | T | calls row/col/depth/depth_col | payload KiB | wire KiB | = theory | param KiB | "
          "saved KiB | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (list(dict.fromkeys(x["layer"] for x in rows)).index(r["layer"]), r["d"])):
        c = "/".join(str(r["calls"][ax]) for ax in AXES)
        print(f"| {r['layer']} | {r['q']} | {r['d']} | {r['T']} | {c} | {r['payload'] / 1024:.2f} | "
              f"{r['wire'] / 1024:.2f} | {'yes' if r['theory'] else 'NO'} | {r['params'] / 1024:.2f} | "
              f"{r['saved'] / 1024:.2f} | {r['err']:.1e} |")


if __name__ == "__main__":
    main()
