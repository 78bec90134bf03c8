"""Compare a model laid out by ``gridshard.parallelize`` with the plain single-device model.

:func:`compare_with_reference` runs on every rank of a gloo group: it builds the plain
reference (``factory()`` laid out at T=1, i.e. materialised whole on this rank) and the
laid-out model from a second ``factory()`` call, then checks on fresh random tokens

* the gathered canonical ``state_dict`` equals the reference's bit for bit (the same
  global model at every layout);
* the loss, the gathered logits and every gathered parameter gradient (by canonical name)
  agree within ``rtol`` (relative to the reference tensor's max-abs).

It returns a small dict of measured errors for the caller to assert on and report.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.ledger import LEDGER
from ..mesh import build_mesh
from ..parallel import context_of, gather_canonical, gathered_state_dict, parallelize
from .compare import relative_error
from .inputs import randint


def gather_logits(logits: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's logits block → the full [b, s, V] logits (cut to the real vocabulary)."""
    mesh, V = ctx.mesh, ctx.vocab_size
    if mesh.tensor.size == 1:
        return logits.detach()[..., :V]
    with LEDGER.paused():
        blocks = C.all_gather(logits.detach().contiguous().unsqueeze(0), mesh.tensor, 0)
    q = mesh.q
    if q is None:                                     # 1D: vocabulary block t of T
        return torch.cat(list(blocks), -1)[..., :V]
    rows = [torch.cat([blocks[i * q + j] for j in range(q)], -1) for i in range(q)]
    return torch.cat(rows, 0)[..., :V]


def compare_with_reference(factory, data: int, tensor: int, mode: str, sequence_parallel: bool = False,
                           batch: int = 4, seq: int = 8, seed: int = 0, hf: bool = False,
                           overlap_input_grad: bool = True) -> dict:
    world = dist.get_world_size()
    ref_mesh = build_mesh(world, 1, 1, "none")
    ref = parallelize(factory(), ref_mesh, seed=seed, device="cpu")
    mesh = build_mesh(data, 1, tensor, mode)
    par = parallelize(factory(), mesh, sequence_parallel=sequence_parallel, seed=seed, device="cpu",
                      overlap_input_grad=overlap_input_grad)
    ctx = context_of(par)

    ref_state = ref.state_dict()
    got_state = gathered_state_dict(par)
    assert list(got_state) == list(ref_state), f"state_dict keys differ: {list(got_state)} vs {list(ref_state)}"
    for k, v in ref_state.items():
        assert got_state[k].shape == v.shape, f"{k}: {tuple(got_state[k].shape)} vs {tuple(v.shape)}"
        assert torch.equal(got_state[k], v), f"{k}: the laid-out model's initial values differ from the plain one"

    V = ctx.vocab_size
    tokens = randint(V, (batch, seq), seed + 11)
    targets = randint(V, (batch, seq), seed + 12)
    ref_logits = context_of(ref).logits(ref, tokens)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V).float(), targets.reshape(-1))
    ref_loss.backward()

    logits = ctx.logits(par, ctx.shard_tokens(tokens))
    loss = ctx.loss(logits, ctx.shard_tokens(targets))
    loss.backward()
    errors = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
              "logits": relative_error(gather_logits(logits, ctx), ref_logits.detach())}
    grads = {}
    for name, p in par.named_parameters(remove_duplicate=False):
        err = grads[f"grad:{name}"] = relative_error(gather_canonical(p.grad, ctx.layouts[name], mesh),
                                                     ref.get_parameter(name).grad)
        assert err == err, f"{name}: NaN gradient"
    return {**errors, **grads, "grad": max(grads.values(), default=0.0)}
