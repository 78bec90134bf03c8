"""Give each rank's parameter blocks their values, without ever building a global tensor
on a rank that does not already hold one.

Two sources, per parameter:

* the plain model holds real values (a Hugging Face model built on CPU, a checkpointed
  plain model): the block is sliced from that global tensor
  (``take_shard(spec.from_canonical(W))``);
* the plain model was built on the meta device: the block is evaluated from the
  parameter's initialisation law on the counter-based generator
  (:func:`gridshard.init.fill_normal_`) at the block's *canonical* global indices, so the
  value of element i of parameter ``name`` is ``law(seed, name, i)`` at every layout,
  and a rank draws exactly its block's numbers (padding rows of a vocabulary table are
  zero and draw nothing).

Laws: ``("normal", std)``, ``("ones",)``, ``("zeros",)``. A model supplies them with an
``init_laws()`` method (name → law); otherwise :func:`default_laws` (matrices normal with
the config's ``initializer_range`` or 0.02, names ending in ``bias`` zeros, other vectors
ones — Hugging Face's Llama init).

Peak host memory above the model: one block at a time is allocated directly on the
target device and filled in chunks of 4 Mi elements, so construction needs about one
shard of parameters plus a few chunk-sized temporaries.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import LayoutError
from ..init import fill_normal_
from ..nn.sharding import ShardSpec, block_dim_indices, get_spec, set_spec, take_shard


def default_laws(model: nn.Module) -> dict:
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    return {name: ("normal", std) if p.dim() >= 2 else ("zeros",) if name.endswith("bias") else ("ones",)
            for name, p in model.named_parameters(remove_duplicate=False)}


def init_laws(model: nn.Module) -> dict:
    own = getattr(model, "init_laws", None)
    return own() if callable(own) else default_laws(model)


def fill_block_(local: torch.Tensor, spec: ShardSpec, index: dict, size: dict, name: str, law, seed: int) -> None:
    """Evaluate ``law`` on this rank's block of the canonical tensor ``name`` into ``local``."""
    kind = law[0]
    if kind in ("ones", "zeros"):
        local.fill_(1.0 if kind == "ones" else 0.0)
        if kind == "ones" and spec.canonical() != spec.global_shape and not spec.transposed:
            _zero_padding(local, spec, index, size)
        return
    if kind != "normal":
        raise LayoutError(f"parallelize: unknown initialisation law {law!r} for {name!r}. "
                          f"Fix: use ('normal', std), ('ones',) or ('zeros',).")
    dims = block_dim_indices(spec, index, size)
    view = local
    if spec.transposed:
        dims, view = dims[::-1], local.t()
    canon = spec.canonical()
    keep = []
    for ix, n in zip(dims, canon):
        v = int((ix < n).sum())
        if not bool((ix[:v] < n).all()):
            raise LayoutError(f"parallelize: padding of {name!r} is not at the end of its block")
        keep.append(v)
    view.zero_()
    sub = view[tuple(slice(0, v) for v in keep)]
    if sub.numel():
        fill_normal_(sub, seed, name, canon, [ix[:v] for ix, v in zip(dims, keep)], std=float(law[1]))


def _zero_padding(local, spec, index, size):
    dims = block_dim_indices(spec, index, size)
    for d, (ix, n) in enumerate(zip(dims, spec.canonical())):
        pad = ix >= n
        if bool(pad.any()):
            local.index_fill_(d, pad.nonzero().flatten().to(local.device), 0.0)


def materialize(model: nn.Module, sources: dict, laws: dict, coords, seed: int, device) -> None:
    """Replace every meta parameter of ``model`` by its block on ``device``; parameters that
    already hold values are moved to ``device``. ``sources``: the plain model's tensors by
    name (meta or real), ``coords``: (index, size) of this rank (:func:`mesh_coords`).
    ``device="meta"``: a layout only (what the memory model reads,
    :mod:`gridshard.parallel.rank_blocks`): the layers' meta blocks and their specs are kept."""
    if torch.device(device).type == "meta":
        return
    index, size = coords
    done: dict = {}
    for module_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            if id(param) in done:
                module._parameters[pname] = done[id(param)]
                continue
            spec = get_spec(param) or ShardSpec(tuple(param.shape))
            source = sources.get(name)
            if param.is_meta:
                local = torch.empty(param.shape, dtype=param.dtype, device=device)
                with torch.no_grad():
                    if source is not None and not source.is_meta:
                        full = spec.from_canonical(source.detach().to(torch.float32).cpu())
                        local.copy_(take_shard(full, spec, index, size))
                    else:
                        if name not in laws:
                            raise LayoutError(f"parallelize: no initialisation law for {name!r}. Fix: give the "
                                              f"model an init_laws() entry for it, or build it with real weights.")
                        fill_block_(local, spec, index, size, name, laws[name], seed)
                new = nn.Parameter(local, requires_grad=param.requires_grad)
            else:
                new = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            if get_spec(param) is not None:
                set_spec(new, get_spec(param))
            module._parameters[pname] = new
            done[id(param)] = new
    for module_name, module in model.named_modules():
        if hasattr(module, "reset_buffers") and any(b is not None and b.is_meta for b in module._buffers.values()):
            module.reset_buffers(device)                # its buffers' starting values, made on ``device``
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                raise LayoutError(f"parallelize: buffer {module_name}.{bname} is still on the meta device and "
                                  f"gridshard does not know how to compute it. Fix: build the model on CPU, or "
                                  f"give it a reset_buffers() method.")
            if buf is not None:
                module._buffers[bname] = buf.to(device)
