"""Where each rank runs, and which of its groups span nodes: ``RUN_DIR/launch.json``.

A rank's node is torchrun's ``GROUP_RANK`` (the index of its node, which the elastic agent sets on
every node), else its host name. At the start of a job with a run directory every rank
contributes its rank, host, node, local rank and the member ranks of each of its mesh groups
(:meth:`gridshard.mesh.ParallelMesh.named_axes`); they are gathered once (two all-gathers over
the world: the lengths, then the JSON bytes, padded) and rank 0 writes::

    {"world_size": 4, "nodes": ["0", "1"], "ranks_per_node": 2,
     "ranks": [{"rank": 0, "host": "h", "node": "0", "local_rank": 0}, ...],
     "groups": {"tensor": [[0, 1, 2, 3]], "data": [[0], ...], ...}}

:func:`spanning_groups` lists the groups whose members sit on more than one node. The source
documents' first rule of layout: a tensor (or context) group exchanges activations in every
layer, so it belongs inside a node, on the fast links; ``gridshard diagnose`` reports one that is
not (:mod:`gridshard.diagnose`).
"""
from __future__ import annotations

import json
import os
import socket

import torch

from ..comm import collectives as C
from ..mesh import world_axis

LAUNCH_FILE = "launch.json"


def this_rank(rank: int, mesh) -> dict:
    """This rank's entry (module docstring)."""
    return {"rank": rank, "host": socket.gethostname(), "node": os.environ.get("GROUP_RANK", socket.gethostname()),
            "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
            "groups": {a.name: list(a.ranks) for a in mesh.named_axes()}}


def gather_placement(rank: int, mesh, ledger) -> dict:
    """Every rank's entry, gathered (on every rank) into the launch record (module docstring)."""
    mine = torch.tensor(list(json.dumps(this_rank(rank, mesh)).encode("utf-8")), dtype=torch.uint8)
    axis = world_axis(ledger)
    with ledger.paused():
        lengths = C.all_gather(torch.tensor([mine.numel()], dtype=torch.int64), axis, dim=0)
        padded = torch.zeros(int(lengths.max()), dtype=torch.uint8)
        padded[:mine.numel()] = mine
        rows = C.all_gather(padded[None], axis, dim=0)
    entries = [json.loads(bytes(rows[r, :int(n)].tolist()).decode("utf-8")) for r, n in enumerate(lengths.tolist())]
    return launch_record(entries)


def launch_record(entries: list) -> dict:
    """The launch record from every rank's entry."""
    nodes = sorted({str(e["node"]) for e in entries})
    groups: dict = {}
    for e in entries:
        for name, members in e["groups"].items():
            if members not in groups.setdefault(name, []):
                groups[name].append(members)
    per_node = [sum(1 for e in entries if str(e["node"]) == n) for n in nodes]
    return {"world_size": len(entries), "nodes": nodes, "ranks_per_node": min(per_node),
            "ranks": [{k: e[k] for k in ("rank", "host", "node", "local_rank")} for e in entries],
            "groups": {name: sorted(members) for name, members in sorted(groups.items())}}


def write_launch_record(run_dir: str, record: dict) -> None:
    with open(os.path.join(run_dir, LAUNCH_FILE), "w") as f:
        json.dump(record, f, indent=1)


def read_launch_record(run_dir: str):
    """The run's launch record, or None when it has none (a run from before it was written) or it does
    not parse (read as data and checked)."""
    path = os.path.join(run_dir, LAUNCH_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("ranks"), list) and isinstance(record.get("groups"), dict)
    return record if ok else None


def spanning_groups(record: dict, axes=("tensor", "context")) -> list:
    """[{"axis", "ranks", "nodes"}] for each group of ``axes`` whose members are on more than one node."""
    node = {int(e["rank"]): str(e["node"]) for e in record["ranks"]}
    out = []
    for name in axes:
        for members in record["groups"].get(name, []):
            nodes = sorted({node[m] for m in members if m in node})
            if len(nodes) > 1:
                out.append({"axis": name, "ranks": list(members), "nodes": nodes})
    return out
