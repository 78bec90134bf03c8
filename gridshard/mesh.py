"""The device layout: data × pipeline × tensor, built on ``torch.distributed.device_mesh``.

Every rank of a job of ``G`` processes sits at one coordinate of a mesh of shape
``(D, P, T)`` with dims named ``("data", "pipeline", "tensor")``; tensor is the
innermost (fastest varying) dim, so a tensor-parallel group is a block of
consecutive global ranks and stays inside a node::

    global_rank = (d * P + p) * T + t

A tensor mode lays the tensor dim out as its scheme says (``TensorScheme.tensor_dims``; more
than one dim is flattened into ``"tensor"`` too) and sets its own attributes on the mesh
(``attach_axes``): 2D's q×q grid and its ``row``/``col`` axes (:mod:`gridshard.tensor.tp2d.scheme`),
2.5D's depth layers (:mod:`gridshard.tensor.tp2p5d.scheme`), 3D's cube (:mod:`gridshard.tensor.tp3d.scheme`).
The mesh knows no mode: it asks the scheme.

Context parallelism (``parallel.context`` C > 1) adds a ``"context"`` dim between pipeline
and tensor: shape ``(D, P, C, T)`` (2D: ``(D, P, C, q, q)``), so

    global_rank = ((d * P + p) * C + c) * T + t

and a context group is C ranks T apart. Parameters are replicated over context ranks as over
data ranks, so gradients are reduced over the flattened ``data_context`` axis (D·C ranks,
``DeviceMesh._flatten`` of data × context). At C = 1 no context dim is built: ``context`` is a
size-1 axis without a group and ``data_context`` *is* ``data``, so a job without context
parallelism is laid out exactly as before.

A mode's depth layers (2.5D) add a ``"depth"`` dim outside the tensor dims, and the dims over which
a mode replicates its weights (``weight_replica_dims``) join ``data_context``. The outer dims, which
are built when, and which replicate weights, are declared in :mod:`gridshard.mesh_dims`.

The expert dimension (``parallel.expert`` E > 1, Mixture-of-Experts) is no new dim: it cuts each
``data_context`` group into blocks of E, the ``expert`` axis, and the ranks at the same place of
every block, the ``expert_data`` axis (:mod:`gridshard.mesh_expert`). At E = 1 ``expert`` has
size 1 and ``expert_data`` *is* ``data_context``.

All size checks happen in :func:`validate_layout`, before any process group is
created, so a bad layout fails with a message instead of hanging.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .device import check_ranks_per_node, device_for_backend, resolve_backend
from .errors import LayoutError
from .job_layout import TensorMode
from .mesh_dims import outer_layout, weight_replica_dims
from .torch_private import flatten_mesh, set_group_timeout
from .mesh_expert import expert_groups
from .netutil import free_port


@dataclass(frozen=True)
class Axis:
    """One dimension of the mesh as seen from this rank.

    ``ranks`` lists the global ranks of the group in group-rank order, so
    ``ranks[k]`` is the global rank of group member ``k`` (what ``broadcast``'s
    ``src`` needs). ``group`` is ``None`` when the axis has size 1. ``ledger``: where
    collectives on this axis are recorded (the mesh's; ``None`` = the current ledger).
    """

    name: str
    size: int
    rank: int
    ranks: tuple
    group: Optional[dist.ProcessGroup]
    ledger: object = field(default=None, compare=False, repr=False)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]


def world_axis(ledger=None) -> Axis:
    """All ranks as one :class:`Axis` (for gathering metrics), recording into ``ledger``."""
    n, r = dist.get_world_size(), dist.get_rank()
    return Axis("world", n, r, tuple(range(n)), dist.group.WORLD if n > 1 else None, ledger)


def factorizations(world_size: int, pipeline: Optional[int] = None, square_tensor: bool = False):
    """All (D, P, T) with D·P·T = world_size for the given P (all P if ``pipeline`` is None).

    With ``square_tensor`` only layouts whose T is a perfect square are listed.
    """
    pipes = [pipeline] if pipeline else range(1, world_size + 1)
    return [(world_size // p // t, p, t) for p in pipes if world_size % p == 0
            for t in range(1, world_size // p + 1)
            if world_size // p % t == 0 and not (square_tensor and math.isqrt(t) ** 2 != t)]


def validate_layout(world_size: int, data: int, pipeline: int, tensor: int, tensor_mode: str = "1d",
                    context: int = 1, depth: int = 1, expert: int = 1) -> None:
    """Check that ``data × pipeline × context × tensor == world_size``, that the tensor mode fits and
    that ``expert`` E divides the weight-replica ranks D·C (2.5D: D·C·d; module docstring).

    Raises :class:`LayoutError` naming the numbers, the rule and valid choices.
    Pure function: touches no process group.
    """
    for name, v in (("data", data), ("pipeline", pipeline), ("context", context), ("tensor", tensor),
                    ("expert", expert)):
        if not isinstance(v, int) or v < 1:
            raise LayoutError(f"parallel.{name}={v!r} is invalid: every parallel size must be an integer >= 1.")
    replicas = data * context * depth                  # the data_context ranks (2.5D: depth layers too)
    if replicas % expert:
        named = "data × context" + (" × depth" if depth > 1 else "")
        raise LayoutError(f"parallel.expert={expert} does not divide {named} = {data}×{context}"
                          f"{f'×{depth}' if depth > 1 else ''} = {replicas}: expert ranks are borrowed from the ranks "
                          f"that replicate the dense weights. Fix: choose expert among the divisors of {replicas}, "
                          f"or raise data.")
    mode = TensorMode.parse(tensor_mode)
    mode.check_tensor_size(tensor, depth)
    if data * pipeline * context * tensor != world_size:
        rest = world_size // context if world_size % context == 0 else world_size
        valid = [v for v in factorizations(rest, pipeline if rest % pipeline == 0 else None)
                 if _fits(mode, v[2], depth)]
        c = "" if context == 1 else f", C={context}" if rest != world_size else ", C=1"
        shown = ", ".join(f"(D={d}, P={p}{c}, T={t})" for d, p, t in valid[:12])
        dims = [(n, v) for n, v in (("data", data), ("pipeline", pipeline), ("context", context), ("tensor", tensor))
                if n != "context" or context > 1]          # context named only when C > 1
        product = data * pipeline * context * tensor
        raise LayoutError(f"{'×'.join(n for n, _ in dims)} = {'×'.join(str(v) for _, v in dims)} = {product} but the "
                          f"world size is {world_size}: the product of the parallel sizes must equal the number of "
                          f"processes. Fix: choose one of {shown}, or launch {product} processes.")


def _fits(mode: TensorMode, T: int, depth: int) -> bool:
    try:
        mode.check_tensor_size(T, depth)
    except LayoutError:
        return False
    return True


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0, run_dir: Optional[str] = None) -> None:
    """Initialise the default process group from torchrun's environment.

    ``backend``: ``parallel.backend`` (``auto | nccl | gloo``; None = auto: nccl on GPUs,
    gloo otherwise, :mod:`gridshard.device`). Under nccl, more ranks on the node
    (``LOCAL_WORLD_SIZE``) than visible GPUs is refused before the group is joined. A single
    process with no launcher environment becomes a world of one. Idempotent.

    The ranks first meet on the group's own store (:func:`gridshard.rendezvous.join`): a rank
    that does not arrive within ``timeout_s`` is named, with what each arrived rank saw. With a
    ``run_dir`` on nccl, the flight recorder's dumps go to ``RUN_DIR/flight_recorder/``.
    """
    if dist.is_initialized():
        return
    import datetime

    from .rendezvous import join, keep_flight_recorder, rank0_store

    backend = resolve_backend(backend or "auto")
    if backend == "nccl":
        check_ranks_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), backend, "--nproc-per-node")
        torch.cuda.set_device(device_for_backend(backend))
        if run_dir is not None:
            keep_flight_recorder(run_dir)
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = elastic_attempt_store(timeout)
    if store is None:
        store = rank0_store(timeout_s)
    join(store, rank, world, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def elastic_attempt_store(timeout):
    """Under PyTorch's elastic agent with its shared store (torchrun, ``--max-restarts``): the
    agent's store under a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``), else None.

    The agent keeps one store for the whole job. Process groups of a restarted attempt would
    otherwise find the previous attempt's keys (the dead workers' gloo addresses) under the
    same names and fail in ``connectFullMesh`` with "Connection refused" (seen with the
    library launcher and gloo on torch 2.13); a prefix per attempt gives every attempt its
    own keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"gridshard/attempt_{attempt}", client)


def device_axis(mesh: DeviceMesh, dim: Optional[str], name: Optional[str] = None, ledger=None) -> Axis:
    """The Axis of ``mesh[dim]`` (or of ``mesh`` itself, a 1-D mesh, when ``dim`` is None)."""
    sub = mesh if dim is None else mesh[dim]
    size, ranks = sub.size(), tuple(int(r) for r in sub.mesh.flatten().tolist())
    return Axis(name or dim, size, ranks.index(dist.get_rank()), ranks, sub.get_group() if size > 1 else None, ledger)


class ParallelMesh:
    """The (data, pipeline[, context], tensor) layout of this job, with one :class:`Axis` per dim.

    Build with :func:`build_mesh`. Attributes:

    * ``data``, ``pipeline``, ``tensor``: axes; ``tensor`` is the flattened tensor dims when the mode lays
      them out on several (the scheme's ``tensor_dims``: 2D's grid, 3D's cube).
    * ``context`` (size C; no group at C = 1) and ``data_context`` (data × context [× depth] [× the mode's
      ``weight_replica_dims``] flattened, the reducer's axis; ``data`` itself when that is all), ``context_size`` C.
    * ``tensor_mode``: the registered scheme (:mod:`gridshard.tensor_scheme`) the model's layers are built
      for (the layer layout's: ``2d`` at 2.5D); ``job_mode``: the config's (``2.5d`` there).
    * ``depth`` (size d, no group at d = 1), ``tensor_depth`` d.
    * ``expert`` (size E; no group at E = 1) and ``expert_data`` (``data_context`` at E = 1): the MoE
      expert axes (module docstring).
    * set by the scheme (``attach_axes``), with these defaults: ``batch_blocks`` / ``batch_index`` (1, 0):
      the blocks a micro-batch's rows are cut into and mine (2D: q and i; 2.5D: d·q and k·q + i; 3D: q²
      and i·q + j); ``logits_batch_index``: the block of the LM head's logits, and so of the targets
      (3D: i·q + l, the swapped orientation); ``q`` (None; 2D: the grid side, with ``grid_row``/``grid_col``
      and the ``row``/``col`` axes); ``cube`` and ``cube_side`` (None; 3D: the residual orientation's
      :class:`gridshard.tensor.tp3d.mesh.Mesh3D` and q); ``tensor_axes``: the extra axes whose groups
      the mesh owns.
    """

    def __init__(self, device_mesh: DeviceMesh, data: int, pipeline: int, tensor: int, tensor_mode: str,
                 flat_tensor_mesh: Optional[DeviceMesh] = None, ledger=None, context: int = 1,
                 flat_data_context_mesh: Optional[DeviceMesh] = None, depth: int = 1, tensor_submesh=None,
                 expert_axes: Optional[tuple] = None):
        self.device_mesh = device_mesh
        self.flat_tensor_mesh = flat_tensor_mesh
        self.flat_data_context_mesh = flat_data_context_mesh
        self.sizes = (data, pipeline, tensor)
        self.context_size = context
        self.job_mode = TensorMode.parse(tensor_mode)
        self.tensor_depth = depth
        self.tensor_mode, layer_tensor = self.job_mode.layer_layout(tensor, depth)
        self.ledger = ledger
        # the outer dims (gridshard.mesh_dims); one the DeviceMesh lacks (context, depth at size 1) has no group
        outer = ("data", "pipeline", "context", "depth")
        self.data, self.pipeline, self.context, self.depth = (
            device_axis(device_mesh, name, ledger=ledger) if name in device_mesh.mesh_dim_names
            else Axis(name, 1, 0, (dist.get_rank(),), None, ledger) for name in outer)
        self.data_context = device_axis(flat_data_context_mesh, None, "data_context", ledger) \
            if flat_data_context_mesh is not None else self.data
        # E > 1: (expert, expert_data) of gridshard.mesh_expert, recording into this mesh's ledger
        self.expert, self.expert_data = (tuple(dataclasses.replace(a, ledger=ledger) for a in expert_axes)
                                         if expert_axes else (Axis("expert", 1, 0, (dist.get_rank(),), None, ledger),
                                                              self.data_context))
        # 2D: the flattened grid, kept from _flatten (slicing it from the root by name is deprecated)
        self.tensor = device_axis(flat_tensor_mesh, None, "tensor", ledger) if flat_tensor_mesh is not None \
            else device_axis(device_mesh, "tensor", ledger=ledger)
        _tensor_defaults(self)
        self.tensor_submesh = tensor_submesh
        self.tensor_axes = self.tensor_mode.attach_axes(self, device_mesh, tensor_submesh, ledger)
        self.logits_batch_index = self.tensor_mode.logits_batch_index(self)

    @property
    def world_size(self) -> int:
        return self.sizes[0] * self.sizes[1] * self.sizes[2] * self.context_size

    def _axes(self) -> list:
        return [self.data, self.pipeline, self.tensor, *self.tensor_axes, self.context, self.depth,
                self.data_context, self.expert, self.expert_data]

    def groups(self) -> list:
        """The distinct process groups of this rank's axes (size-1 axes have none)."""
        return list({id(a.group): a.group for a in self._axes() if a.group is not None}.values())  # each once, in order

    def named_axes(self) -> list:
        """This rank's axes of more than one rank, each name once (what ``RUN_DIR/launch.json`` records)."""
        named: dict = {}
        for a in self._axes():
            if a.size > 1:
                named.setdefault(a.name, a)
        return list(named.values())

    def __repr__(self) -> str:
        d, p, t = self.sizes
        c = f", C={self.context_size}" if self.context_size > 1 else ""
        c += f", depth={self.tensor_depth}" if self.tensor_depth > 1 else ""
        c += f", E={self.expert.size}" if self.expert.size > 1 else ""
        return f"ParallelMesh(D={d}, P={p}{c}, T={t}, mode={self.job_mode!r}, rank={dist.get_rank()})"


def build_mesh(data: int = 1, pipeline: int = 1, tensor: int = 1, tensor_mode: Optional[str] = None,
               ledger=None, context: int = 1, depth: int = 1, expert: int = 1) -> ParallelMesh:
    """Validate the layout, then build (or reuse, :func:`layout_mesh`) the mesh for it.

    ``tensor_mode`` defaults to ``"none"`` for T=1 and ``"1d"`` otherwise.
    The process group must already be initialised (:func:`init_distributed`).
    Calling this repeatedly creates no new process groups: without ``ledger`` the same
    :class:`ParallelMesh` comes back; with one, a mesh over the same device meshes whose axes
    record into it. ``ledger``: a :class:`gridshard.comm.CommLedger` that records this mesh's
    collectives (a job's own; default: the current ledger, ``gridshard.LEDGER``). ``context``:
    C, the ranks one sequence is split over; ``depth``: d, the 2.5D depth layers; ``expert``: E, the ranks
    one MoE layer's experts are split over (module docstring).
    """
    tensor_mode = TensorMode.parse(tensor_mode if tensor_mode is not None else "none" if tensor == 1 else "1d")
    if not dist.is_initialized():
        raise LayoutError("build_mesh() needs an initialised process group: call gridshard.init_distributed() first.")
    validate_layout(dist.get_world_size(), data, pipeline, tensor, tensor_mode, context, depth, expert)
    mesh = layout_mesh(dist.group.WORLD, data, pipeline, tensor, tensor_mode, context, depth, expert)
    if ledger is None:
        return mesh
    return ParallelMesh(mesh.device_mesh, data, pipeline, tensor, tensor_mode, mesh.flat_tensor_mesh, ledger,
                        context, mesh.flat_data_context_mesh, depth, mesh.tensor_submesh,
                        (mesh.expert, mesh.expert_data) if expert > 1 else None)


@functools.lru_cache(maxsize=32)
def layout_mesh(world_group, data: int, pipeline: int, tensor: int, tensor_mode: TensorMode,
                context: int = 1, depth: int = 1, expert: int = 1) -> ParallelMesh:
    """The :class:`ParallelMesh` (recording into the current ledger) of a validated layout of
    ``world_group``, over a new DeviceMesh (and, in 2D and 3D, its flattened tensor mesh; in 3D the
    cube's :class:`Mesh3D` and its two flattened groups, once).

    A memo keyed by the world process group and the layout, bounded to 32 layouts: creating a
    DeviceMesh creates its process groups (a collective over every rank, with sockets that live
    as long as the process), so a process that builds the same layout many times (the test
    harness's workers, evaluation, export) builds it once. Every rank calls it in the same
    order, so the memo's hits and evictions are the same on every rank. The new groups wait as
    long as ``world_group`` (:func:`set_collective_timeout`), not torch's default for new groups."""
    device_type = "cuda" if dist.get_backend(world_group) == "nccl" else "cpu"
    outer_names, outer = zip(*outer_layout({"data": data, "pipeline": pipeline, "context": context, "depth": depth}))
    layer_mode, layer_tensor = tensor_mode.layer_layout(tensor, depth)
    names, sizes = zip(*layer_mode.tensor_dims(layer_tensor))
    dm = init_device_mesh(device_type, outer + sizes, mesh_dim_names=outer_names + names)
    flat = flatten_mesh(dm[names], "tensor") if len(names) > 1 else None
    submesh = layer_mode.tensor_submesh(dm[names])
    replicas = weight_replica_dims(outer_names) + layer_mode.weight_replica_dims()   # data, [context,] [depth], …
    flat_dc = flatten_mesh(dm[replicas], "data_context") if len(replicas) > 1 else None
    mesh = ParallelMesh(dm, data, pipeline, tensor, tensor_mode, flat, context=context,
                        flat_data_context_mesh=flat_dc, depth=depth, tensor_submesh=submesh)
    if expert > 1:
        groups = expert_groups(dm, replicas, expert, mesh.data_context.size)
        mesh.expert, mesh.expert_data = (Axis(name, len(ranks), ranks.index(dist.get_rank()), ranks, group)
                                         for name, (ranks, group) in groups.items())
    world_timeout = group_timeout_s(world_group)
    if world_timeout is not None:
        set_collective_timeout(mesh.groups(), world_timeout)
    return mesh


def group_timeout_s(group) -> Optional[float]:
    """How long (seconds) a collective on ``group`` waits before it fails; None when the backend
    does not say. Read from the backend's options (a private attribute of torch's
    ``ProcessGroup``; torch has no public reader)."""
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def set_collective_timeout(groups, seconds: float) -> None:
    """Make every collective on ``groups`` (process groups; None entries skipped) fail after
    ``seconds`` of waiting.

    Why it is needed: torch gives a group created by ``new_group`` or ``init_device_mesh`` the
    backend's *default* timeout (gloo 30 min, NCCL 10 min), not the one ``init_process_group``
    got, so the mesh's data, pipeline and tensor groups would ignore
    ``train.collective_timeout_s`` (seen on torch 2.13). :func:`layout_mesh` gives them the
    world group's; ``train.compile``'s first step raises and then restores it
    (:mod:`gridshard.engine.warmup`). Uses :func:`gridshard.torch_private.set_group_timeout`
    (a private torch name; what torchtitan uses to tighten the timeout after its first step)."""
    import datetime

    timeout = datetime.timedelta(seconds=seconds)
    for group in groups:
        if group is not None:
            set_group_timeout(timeout, group)


class ShapeMesh:
    """The sizes and one rank's coordinates of a layout, with no process group: what the layer
    constructors and :func:`gridshard.parallelize` read of a :class:`ParallelMesh` (``tensor_mode``,
    each :class:`Axis`'s size and rank, and in 2D ``q``, ``grid_row``/``grid_col`` and the ``row``/
    ``col`` axes), so a model can be laid out on the meta device for a layout nobody launched
    (:mod:`gridshard.parallel.rank_blocks`). Its axes have ``group=None``: it lays out, it never
    runs a collective. ``tensor_rank`` t = i·q + j in 2D, t = (i·q + j)·q + l in 3D (``cube``: a
    shape-only :class:`Mesh3D`), as on a real mesh."""

    def __init__(self, data: int = 1, pipeline: int = 1, tensor: int = 1, tensor_mode: Optional[str] = None,
                 tensor_rank: int = 0, context: int = 1, context_rank: int = 0, expert: int = 1):
        self.tensor_mode = TensorMode.parse(tensor_mode if tensor_mode is not None else "none" if tensor == 1
                                            else "1d")
        self.tensor_mode.check_tensor_size(tensor)
        self.sizes = (data, pipeline, tensor)
        self.ledger = None
        self.data, self.pipeline = shape_axis("data", data, 0), shape_axis("pipeline", pipeline, 0)
        self.context_size = context
        self.context = shape_axis("context", context, context_rank)
        self.data_context = shape_axis("data_context", data * context, context_rank) if context > 1 else self.data
        self.tensor = shape_axis("tensor", tensor, tensor_rank)
        self.depth, self.tensor_depth = shape_axis("depth", 1, 0), 1
        self.expert = shape_axis("expert", expert, 0)
        self.expert_data = shape_axis("expert_data", data * context // expert, 0)
        _tensor_defaults(self)
        self.tensor_mode.attach_shape_axes(self, tensor_rank)
        self.logits_batch_index = self.tensor_mode.logits_batch_index(self)

    world_size = ParallelMesh.world_size

    def __repr__(self) -> str:
        d, p, t = self.sizes
        return f"ShapeMesh(D={d}, P={p}, T={t}, mode={self.tensor_mode!r}, tensor_rank={self.tensor.rank})"


def _tensor_defaults(mesh) -> None:
    """What a mesh of a mode without a grid or cube says: one batch block, no side, no cube (a
    scheme's ``attach_axes`` / ``attach_shape_axes`` overrides them)."""
    mesh.q, mesh.cube, mesh.cube_side = None, None, None
    mesh.batch_blocks, mesh.batch_index = 1, 0


def shape_axis(name: str, size: int, rank: int) -> Axis:
    return Axis(name, size, rank, tuple(range(size)), None)
