"""The expert dimension of a mesh: ``parallel.expert`` = E borrowed from the weight-replica ranks.

The R ranks of a ``data_context`` group (:mod:`gridshard.mesh`: D·C[·d] ranks holding the same
dense parameters) are cut, in their group order, into R/E blocks of E consecutive ranks:

    member m of data_context  →  expert rank ε = m mod E,   expert-data rank δ = m div E

* ``expert`` (E ranks, one block): they hold different experts — expert rank ε holds experts
  ε·n/E … (ε+1)·n/E − 1 — and exchange tokens (:mod:`gridshard.moe.dispatch`);
* ``expert_data`` (R/E ranks, one per block, the same ε): they hold the same experts and reduce
  those experts' gradients (:mod:`gridshard.zero`).

Consecutive members are the innermost replica dim first (context ranks, then data ranks), so at
T = P = 1 an expert group is E consecutive global ranks: inside one node, where the dispatch's
all-to-all is cheapest.

Why ``dist.new_group`` and not a DeviceMesh: the blocks are a reshape of a flattened mesh dim,
which ``DeviceMesh._unflatten`` expresses only on torch ≥ 2.8 (the package supports 2.6); the
groups are plain process groups every rank creates in the same order. :mod:`gridshard.mesh` makes
the two :class:`~gridshard.mesh.Axis` of them (this file imports nothing of gridshard).
"""
from __future__ import annotations

import torch.distributed as dist


def expert_groups(device_mesh, replica_dims: tuple, expert: int, replicas: int) -> dict:
    """name → (ranks, process group or None at size 1) of this rank's ``expert`` and ``expert_data``
    groups for E = ``expert`` over the weight-replica dims ``replica_dims`` of ``device_mesh`` (the
    dims flattened into the ``data_context`` axis, ``replicas`` = R ranks). Every rank creates every
    group, in the same order."""
    names = list(device_mesh.mesh_dim_names)
    order = [i for i, n in enumerate(names) if n not in replica_dims] + [names.index(n) for n in replica_dims]
    rows = device_mesh.mesh.permute(order).reshape(-1, replicas)        # each row: one data_context group
    me, found = dist.get_rank(), {}
    for row in rows:
        blocks = row.view(-1, expert)
        for name, groups in (("expert", blocks), ("expert_data", blocks.t())):
            for ranks in groups.tolist():
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if me in ranks:
                    found[name] = (tuple(ranks), group)
    return found
