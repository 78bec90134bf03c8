"""3D layers at the layer level: what each one moves and stores per rank, from the ledger, on
CPU/gloo (q = 2, 8 ranks by default).

For each layer, one forward + backward on the same global batch of b sequences of s tokens
(fp32, fresh weights from one seed, no GatheredVectors window), the same layers and sizes as
the former 2.5D layer-level ledger benchmark so the rows can be read side by side:

* ``linear``: Linear3D h → f with bias; ``mlp``: Linear3D h → f (bias), GELU, Linear3D f → h
  (bias) on the swapped mesh (back to the input's layout);
* ``rmsnorm``: RMSNorm3D h; ``embedding``: VocabParallelEmbedding3D V × h;
* ``head+loss``: VocabParallelClassifier3D h → V and cross_entropy_3d (mean, a few targets masked).

Columns: calls per physical ledger axis (weight / input / output / weight_input /
weight_output), payload and ring wire KiB per rank (the ledger's own figures), ``= theory`` (the
ledger equals :mod:`gridshard.tensor.tp3d.theory` call for call and byte for byte), parameter KiB per
rank, saved-for-backward KiB per rank (``saved_tensors_hooks``, parameters excluded) and the
largest relative error of the output and the gradients against one process.

    .venv/bin/python benchmarks/bench_tp3d_ledger.py [--q 2 --b 16 --s 64 --h 64 --f 256 --vocab 509]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AXES = ("weight", "input", "output", "weight_input", "weight_output")


def _layers(mesh, a):
    """(name, parallel module, plain module, input kind), each pair built from one seed."""
    import torch
    from torch import nn

    from gridshard.tensor.tp3d.embedding import VocabParallelEmbedding3D
    from gridshard.tensor.tp3d.linear import Linear3D, VocabParallelClassifier3D
    from gridshard.tensor.tp3d.norm import RMSNorm3D
    from gridshard.testing.plain import plain_embedding, plain_lm_head, plain_linear

    def pair(make_par, make_ref):
        torch.manual_seed(7)
        par = make_par()
        torch.manual_seed(7)
        return par, make_ref()

    sw = mesh.swapped()
    return [
        ("linear", *pair(lambda: Linear3D(a.h, a.f, mesh, init_std=0.05), lambda: plain_linear(a.h, a.f, True, 0.05)),
         "x"),
        ("mlp", *pair(lambda: nn.Sequential(Linear3D(a.h, a.f, mesh, init_std=0.05), nn.GELU(),
                                            Linear3D(a.f, a.h, sw, init_std=0.05)),
                      lambda: nn.Sequential(plain_linear(a.h, a.f, True, 0.05), nn.GELU(),
                                            plain_linear(a.f, a.h, True, 0.05))), "x"),
        ("rmsnorm", *pair(lambda: RMSNorm3D(a.h, mesh), lambda: nn.RMSNorm(a.h, eps=1e-5)), "x"),
        ("embedding", *pair(lambda: VocabParallelEmbedding3D(a.vocab, a.h, mesh, 0.05),
                            lambda: plain_embedding(a.vocab, a.h, 0.05)), "tokens"),
        ("head+loss", *pair(lambda: VocabParallelClassifier3D(a.h, a.vocab, mesh, init_std=0.05),
                            lambda: plain_lm_head(a.h, a.vocab, 0.05)), "loss"),
    ]


def _theory(name, q, a):
    from gridshard.tensor.tp3d import theory as T

    n = a.b * a.s
    return {"linear": lambda: T.linear3d_comm(n, a.h, a.f, q, bias=True),
            "mlp": lambda: T.combine(T.linear3d_comm(n, a.h, a.f, q, bias=True),
                                     T.linear3d_comm(n, a.f, a.h, q, bias=True, swapped=True)),
            "rmsnorm": lambda: T.rmsnorm3d_comm(n, a.h, q),
            "embedding": lambda: T.embedding3d_comm(a.b, a.s, a.h, q),
            "head+loss": lambda: T.combine(T.head3d_comm(n, a.h, a.vocab, q), T.cross_entropy3d_comm(n, q, True)),
            }[name]()


def _out_mesh(par, mesh):
    """The orientation a module's output is in (a linear flips it; an MLP of two flips it back)."""
    last = par[-1] if hasattr(par, "__getitem__") else par
    return getattr(last, "out_mesh", mesh)


def _run_one(mesh, par, ref, kind, a):
    """Forward + backward of both; returns (largest relative error, saved bytes of the parallel one)."""
    import torch
    import torch.nn.functional as F

    from gridshard.tensor.tp3d.cross_entropy import cross_entropy_3d
    from gridshard.nn.sharding import take_shard
    from gridshard.testing.compare import relative_error
    from gridshard.testing.inputs import randint, randn

    out = _out_mesh(par, mesh)
    blk = lambda t, m, hidden=True: m.batch_block(t.detach(), hidden=hidden).clone(  # noqa: E731
        memory_format=torch.contiguous_format)
    if kind == "tokens":
        X = randint(a.vocab, (a.b, a.s), 3)
        x = blk(X, mesh, hidden=False)
    else:
        X = randn((a.b, a.s, a.h), 3).requires_grad_()
        x = blk(X, mesh).requires_grad_()
    saved, y = _saved_bytes(par, lambda: par(x))
    Y = ref(X)
    if kind == "loss":
        targets = randint(a.vocab, (a.b, a.s), 4)
        targets[0, :3] = -100
        F.cross_entropy(Y.reshape(-1, a.vocab), targets.reshape(-1)).backward()
        y = cross_entropy_3d(y, blk(targets, out, hidden=False), out, a.vocab)
        y.backward()
        errs = [relative_error(y, F.cross_entropy(Y.detach().reshape(-1, a.vocab), targets.reshape(-1)))]
    else:
        G = randn(Y.shape, 5)
        Y.backward(G)
        y.backward(blk(G, out))
        errs = [relative_error(y, blk(Y, out))]
    if kind != "tokens":
        errs.append(relative_error(x.grad, blk(X.grad, mesh)))
    refs = dict(ref.named_parameters())
    for name, p in par.named_parameters():      # the canonical gradient laid out as the parameter is
        spec = p.shard_spec
        errs.append(relative_error(p.grad, take_shard(spec.from_canonical(refs[name].grad), spec, mesh.coords(),
                                                      mesh.sizes())))
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


def _measure(q, a):
    from gridshard.comm import LEDGER
    from gridshard.tensor.tp3d.mesh import build_mesh_3d

    mesh = build_mesh_3d(q)
    rows = []
    for name, par, ref, kind in _layers(mesh, a):
        LEDGER.reset()
        err, saved = _run_one(mesh, par, ref, kind, a)
        seen = {k: (e.count, e.payload_bytes, e.wire_bytes) for k, e in LEDGER.entries.items() if e.count}
        expect = {(op, ax): (v.calls[op], v.payload[op]) for ax, v in _theory(name, q, a).items() for op in v.calls}
        calls = {ax: sum(c for (op, x), (c, _, _) in seen.items() if x == ax) for ax in AXES}
        rows.append(dict(layer=name, q=q, T=q ** 3, calls=calls, payload=sum(p for _, p, _ in seen.values()),
                         wire=sum(w for _, _, w in seen.values()), theory={k: v[:2] for k, v in seen.items()} == expect,
                         params=sum(p.numel() * p.element_size() for p in par.parameters()), saved=saved, err=err))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--q", type=int, default=2)
    p.add_argument("--b", type=int, default=16)
    p.add_argument("--s", type=int, default=64)
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--f", type=int, default=256)
    p.add_argument("--vocab", type=int, default=509)
    a = p.parse_args(argv)
    from benchmarks import bench_tp3d_ledger as me     # by module name: the workers import it
    from gridshard.testing import run_on_ranks, shutdown_all

    rows = run_on_ranks(a.q ** 3, me._measure, a.q, a, timeout=600)[0]
    shutdown_all()
    print(f"3D layers, fp32 CPU/gloo, b={a.b} s={a.s} h={a.h} f={a.f} V={a.vocab}; one forward + backward, per rank")
    print("| layer | q | T | calls weight/input/output/weight_input/weight_output | payload KiB | wire KiB | "
          "= theory | param KiB | saved KiB | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = "/".join(str(r["calls"][ax]) for ax in AXES)
        print(f"| {r['layer']} | {r['q']} | {r['T']} | {c} | {r['payload'] / 1024:.2f} | {r['wire'] / 1024:.2f} | "
              f"{'yes' if r['theory'] else 'NO'} | {r['params'] / 1024:.2f} | {r['saved'] / 1024:.2f} | "
              f"{r['err']:.1e} |")


if __name__ == "__main__":
    main()
