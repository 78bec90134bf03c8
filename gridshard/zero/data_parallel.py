"""ZeRO-1/2/3 data parallelism over ``mesh.data``: the reduction that replaces the plain
all-reduce of :class:`gridshard.zero.grad_buffer.DataParallelGradSync` when ``train.zero ≥ 1``
(both are :class:`gridshard.zero.reducer.GradReducer`).

Shards. Every trainable parameter's local block ``[n0, *rest]`` (the tensor-parallel shard
this rank stores) is split by rows over the D data ranks (:mod:`gridshard.theory.zero`):
data rank r owns rows ``[start_r, stop_r)``, a box of the canonical tensor. The optimizer
(AdamW, element-wise) steps only those rows, so its two moments are ``s = (stop−start)·R``
elements per parameter instead of ``n0·R``.

Units. Parameters are grouped into *units*: one per decoder layer (``layers.N`` /
``model.layers.N``) and one *root* unit with everything else (embedding, final norm, head;
a tied weight once). A unit's parameters travel together: one reduce-scatter and (ZeRO-3)
one all-gather per unit, over a flat buffer of D equal segments; rank r's segment holds,
parameter after parameter, its rows padded to ``c = ceil(n0/D)`` rows (zeros).

Stages (what each data rank keeps between steps, fp32; Ψ = local elements, Ψ/D ≈ shard):

====  ===================  ==========================  =================================
ZeRO  parameters           gradients                   AdamW moments
====  ===================  ==========================  =================================
0     full block           full block (all-reduced)    full block
1     full block           full block + shard          shard   (rows)
2     full block           shard only                  shard
3     shard only           shard only                  shard
====  ===================  ==========================  =================================

One step, ``A`` micro-batches (``g`` = local gradient, summed over micro-batches locally
with no communication; only the last micro-batch's backward reduces):

1. backward of every micro-batch accumulates ``p.grad`` (full block) as usual;
2. in the last backward, the moment a unit's gradients are complete (a post-accumulate-grad
   hook counts them) its gradients are packed into the flat buffer and one asynchronous
   ``reduce_scatter`` over data is issued (``overlap``; else after the backward). ZeRO-2/3
   drop the full ``p.grad`` right after packing; ZeRO-1 keeps it. At most ``MAX_IN_FLIGHT``
   reduce-scatters are outstanding: launching another first waits for the oldest, so the
   packed input buffers (D·segment each) do not pile up over the whole backward. With
   A > 1 the full gradients live from the first micro-batch's backward to the last one's
   (accumulation without communication, 4 bytes per local element, as at ZeRO-0);
3. :meth:`sync` waits, divides the segment by D (the data mean) and hands each shard a
   gradient view into the segment;
4. clipping and AdamW act on the shards (the norm counts each shard once: sum of squares
   over tensor *and* data ranks);
5. :meth:`after_step` (ZeRO-1/2): one ``all_gather`` per unit of the updated rows refreshes
   every rank's full parameters. ZeRO-3 gathers lazily instead (below).

Why packed and not views of a persistent buffer (as ZeRO-0's :mod:`.grad_buffer`): the
reduce-scatter's input is rank-major (rank j's rows of every parameter of the unit, then rank
j+1's), so a parameter's rows are spread over D segments and its ``[n0, *rest]`` gradient is no
strided view of it once a unit holds two parameters; sharding by element ranges instead (as
Megatron-core's distributed optimizer) would cut rows, and a shard would no longer be a box of
the canonical tensor. A persistent full-size buffer would also keep every unit's full gradient
alive, which is what ZeRO-2/3 exist to avoid. So ZeRO ≥ 1 packs each unit once per step into a
transient buffer (at most ``MAX_IN_FLIGHT`` outstanding), uninitialised where every element is
written.

ZeRO-3 parameters. Between uses a parameter's storage is freed (``resize_(0)``; the
tensor object, its name and its autograd identity stay) and its rows live in the unit's
flat shard buffer, which the optimizer updates in place. A forward pre-hook on the unit's
module gathers the unit (all-gather of the flat shards, copied into the parameters'
storage); after the forward the layer is freed again; an identity autograd function on the
layer's outputs gathers it again when backward reaches the layer (the saved activations
refer to the same storage, so they see the same values); when the layer's gradients are
complete it is freed. The root unit stays gathered from its first use in forward to the
step's reduction (:meth:`sync`): the head is the first thing every backward needs and the
embedding the first thing every forward needs. With ``train.recompute=full`` the
recomputation runs inside the layer's backward, after the regather.

Communication per step and rank (payloads as the ledger records them, S_u = D · Σ_p c_p·R_p
elements of unit u, 4 bytes each; :func:`gridshard.theory.zero.zero_step_comm`):

* ZeRO-1/2: one reduce-scatter of S_u and one all-gather of S_u per unit — on a ring
  (D−1)/D·S_u each, together the wire bytes of the all-reduce they replace (up to padding);
* ZeRO-3: one reduce-scatter per unit, two all-gathers per decoder layer and micro-batch
  (forward and backward) and one per step for the root unit — with one micro-batch 1.5× the
  all-reduce's wire bytes.

Why our own and not FSDP2 / ``ZeroRedundancyOptimizer``: (1) a shard here is a *box of the
canonical tensor* (rows of the tensor-parallel block, including the 2D norm pieces and the
kv blocks replicated over T/kv that DTensor placements cannot describe), which the
checkpoint planner writes as one chunk — so checkpoints reshard between ZeRO stages, data
sizes and tensor layouts by overlap alone, with no gather at save time;
``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (its state is not a box of
anything a different D can read) and FSDP2 drops the tensor-parallel layout attributes of
plain-tensor parameters; (2) every collective goes through :mod:`gridshard.comm.collectives`
and is in the ledger, so the step's bytes are asserted against the formula; (3) the
reduction is an explicit sum then ÷D, which sidesteps FSDP2's reported averaging trap on
gloo (pytorch #162338); (4) the pipeline runner and the tied-embedding sync work on plain
``p.grad`` until :meth:`sync`, unchanged. The row split is the same one FSDP2 uses (dim 0).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..comm import collectives as C
from ..parallel.decoder_layers import decoder_layers
from ..theory.zero import owned_rows, rows_per_rank
from .reducer import SteppedTensor

MAX_IN_FLIGHT = 2          # reduce-scatters outstanding in backward; the oldest is waited for beyond it


@dataclass
class ShardedParam:
    """One parameter under ZeRO: its local block and this data rank's rows of it. Where the rows
    sit in the canonical tensor is the parameter's layout narrowed to ``(start, stop)``
    (:meth:`gridshard.nn.sharding.ShardSpec.canonical_box`, read through
    :attr:`gridshard.zero.reducer.SteppedTensor.rows`); ``offset`` and ``padded`` place them in
    the unit's communication buffer, nothing else."""

    name: str
    param: nn.Parameter
    shape: tuple                 # the local (tensor-parallel) block, [n0, *rest]
    start: int                   # owned rows [start, stop)
    stop: int
    offset: int                  # where its padded rows start inside a unit segment
    padded: int                  # c · R: elements per rank segment
    shard: Optional[torch.Tensor] = None     # what the optimizer steps: [stop − start, *rest]

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:])

    def rows_of(self, data: int, rank: int) -> tuple:
        return owned_rows(self.shape[0], data, rank)


@dataclass
class Unit:
    """Parameters gathered, reduced and freed together (a decoder layer, or the root)."""

    name: str
    params: list
    segment: int = 0             # elements of one rank's segment (Σ padded)
    ready: int = 0               # gradients accumulated in the current backward
    pending: object = None       # PendingCollective of the reduce-scatter in flight
    reduced: object = None       # this rank's summed segment after sync
    flat_shard: Optional[torch.Tensor] = None   # ZeRO-3: this rank's rows of every parameter
    gathered: bool = True
    modules: list = field(default_factory=list)


class _RegatherInBackward(torch.autograd.Function):
    """Identity on a layer's output whose backward gathers the layer's parameters (ZeRO-3):
    backward reaches a layer's outputs before anything inside the layer."""

    @staticmethod
    def forward(ctx, x, zero, unit):
        ctx.zero, ctx.unit = zero, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.zero.gather(ctx.unit, in_backward=True)
        return grad, None, None


class ZeroDataParallel:
    """ZeRO stage ``stage`` (1–3) of ``model`` (laid out by :func:`gridshard.parallelize`) over
    ``data_axis`` (module docstring). ``overlap``: issue each unit's reduce-scatter in the last
    backward as soon as its gradients are complete."""

    def __init__(self, model: nn.Module, data_axis, stage: int, overlap: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroDataParallel: stage {stage} is not 1, 2 or 3")
        self.model, self.axis, self.stage = model, data_axis, stage
        self.overlap = overlap and data_axis.size > 1
        self.units = self._build_units(model)
        self._armed = False
        self._in_flight: list = []                     # units whose reduce-scatter is outstanding, oldest first
        for u in self.units:
            dtype, device = u.params[0].param.dtype, u.params[0].param.device
            if stage == 3:
                u.flat_shard = torch.zeros(u.segment, dtype=dtype, device=device)
            for sp in u.params:
                rows = sp.stop - sp.start
                with torch.no_grad():
                    if stage == 3:
                        sp.shard = u.flat_shard[sp.offset:sp.offset + rows * sp.row_elems].view(rows, *sp.shape[1:])
                        sp.shard.copy_(sp.param.detach()[sp.start:sp.stop])
                    else:
                        sp.shard = sp.param.detach()[sp.start:sp.stop]
            for sp in u.params:
                sp.param.register_post_accumulate_grad_hook(self._on_grad(u))
            self._free(u)                              # ZeRO-3: the rows are in the flat shard now
        if stage == 3:
            self._install_gather_hooks()
        model.grad_reducer = self                      # gathered_state_dict finds the shards through it

    # ---- construction ------------------------------------------------------------------
    def _build_units(self, model) -> list:
        layers = decoder_layers(model)
        units, seen = [], set()
        for lname, module in layers:
            u = Unit(lname, [], modules=[module])
            for pname, p in module.named_parameters(prefix=lname):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    u.params.append(pname)
            units.append(u)
        root = Unit("root", [])
        for pname, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                root.params.append(pname)
        if root.params:
            units.append(root)
        named = dict(model.named_parameters())
        D, r = self.axis.size, self.axis.rank
        out = []
        for u in units:
            sps, offset = [], 0
            for pname in u.params:
                p = named[pname]
                if p.dim() == 0:
                    raise ValueError(f"ZeRO: parameter {pname!r} is a scalar; ZeRO splits parameters by rows")
                shape = tuple(p.shape)
                start, stop = owned_rows(shape[0], D, r)
                padded = rows_per_rank(shape[0], D) * math.prod(shape[1:])
                sps.append(ShardedParam(pname, p, shape, start, stop, offset, padded))
                offset += padded
            dtypes = {sp.param.dtype for sp in sps}
            if len(dtypes) > 1:
                raise ValueError(f"ZeRO: unit {u.name} mixes parameter dtypes {dtypes}; keep parameters in one dtype")
            u.params, u.segment = sps, offset
            if sps:
                out.append(u)
        for u in out:                               # modules that own root parameters directly
            if u.name == "root":
                ids = {id(sp.param) for sp in u.params}
                u.modules = [m for m in model.modules()
                             if any(id(p) in ids for p in m.parameters(recurse=False))]
        return out

    def _install_gather_hooks(self) -> None:
        for u in self.units:
            for module in u.modules:
                module.register_forward_pre_hook(self._pre_forward(u))
                if u.name != "root":
                    module.register_forward_hook(self._post_forward(u))

    def _pre_forward(self, u):
        def hook(_module, _args):
            self.gather(u)
        return hook

    def _post_forward(self, u):
        def hook(_module, _args, output):
            self._free(u)
            if not torch.is_grad_enabled():
                return output
            return _map_tensors(output, lambda x: _RegatherInBackward.apply(x, self, u)
                                if x.requires_grad else x)
        return hook

    # ---- ZeRO-3 gather / free ----------------------------------------------------------------
    @torch.no_grad()
    def gather(self, u: Unit, in_backward: bool = False) -> None:
        """All-gather unit ``u``'s rows into its parameters' storage (no-op if gathered)."""
        if u.gathered:
            return
        for sp in u.params:
            storage = sp.param.untyped_storage()
            storage.resize_(sp.param.numel() * sp.param.element_size())
        full = C.all_gather(u.flat_shard, self.axis, dim=0)
        # in backward the autograd graph holds these parameters: keep their version counter
        for sp in u.params:
            if in_backward:
                with torch.autograd._unsafe_preserve_version_counter(sp.param):
                    self._unpack_into(full, u, sp, sp.param)
            else:
                self._unpack_into(full, u, sp, sp.param)
        u.gathered = True

    def _free(self, u: Unit) -> None:
        if self.stage != 3 or not u.gathered:
            return
        for sp in u.params:
            sp.param.untyped_storage().resize_(0)
        u.gathered = False

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole on every data rank inside the block (ZeRO-3: one all-gather per
        unit; a collective, every rank enters it); freed again after."""
        for u in self.units:
            self.gather(u)
        try:
            yield
        finally:
            self.free_all()

    def free_all(self) -> None:
        """ZeRO-3: free every gathered unit (e.g. the root after an evaluation)."""
        for u in self.units:
            self._free(u)

    def _rank_rows(self, buf: torch.Tensor, u: Unit, sp: ShardedParam, whole: torch.Tensor) -> list:
        """(rows of ``sp`` in the [D · segment] buffer ``buf``, the same rows of ``whole``, the
        flat parameter-sized tensor) pairs, one per data rank that holds rows; without padding
        one strided pair for all ranks (one copy)."""
        D, R = self.axis.size, sp.row_elems
        c = rows_per_rank(sp.shape[0], D)
        if c * D == sp.shape[0]:
            return [(buf.view(D, u.segment)[:, sp.offset:sp.offset + c * R], whole.view(D, c * R))]
        pairs = []
        for j in range(D):
            a, b = sp.rows_of(D, j)
            if b > a:
                base = j * u.segment + sp.offset
                pairs.append((buf[base:base + (b - a) * R], whole[a * R:b * R]))
        return pairs

    def _unpack_into(self, full: torch.Tensor, u: Unit, sp: ShardedParam, target: torch.Tensor) -> None:
        """Copy every rank's rows of ``sp`` from the gathered [D · segment] buffer into ``target``."""
        for segment, rows in self._rank_rows(full, u, sp, target.view(-1)):
            rows.copy_(segment)

    # ---- gradients -------------------------------------------------------------------------
    def _on_grad(self, u: Unit):
        def on_grad_ready(_param):
            u.ready += 1
            if u.ready < len(u.params):
                return
            u.ready = 0
            if self._armed and u.pending is None and u.reduced is None:
                self._launch(u)
            if self.stage == 3 and u.name != "root":
                self._free(u)
        return on_grad_ready

    def arm(self) -> None:
        """The next backward is the step's last: reduce each unit as soon as it is complete."""
        if self.overlap:
            self._armed = True
            for u in self.units:
                u.ready = 0

    @torch.no_grad()
    def _launch(self, u: Unit) -> None:
        D, first = self.axis.size, u.params[0].param
        # every element is written below unless a row is padding or a parameter got no gradient
        covered = all(sp.param.grad is not None and rows_per_rank(sp.shape[0], D) * D == sp.shape[0]
                      for sp in u.params)
        flat = (torch.empty if covered else torch.zeros)(D * u.segment, dtype=first.dtype, device=first.device)
        for sp in u.params:
            g = sp.param.grad
            if g is None:
                continue
            for segment, rows in self._rank_rows(flat, u, sp, g.reshape(-1)):
                segment.copy_(rows)
            if self.stage >= 2:
                sp.param.grad = None               # only the shard's gradient is kept
        u.pending = C.reduce_scatter_flat(flat, self.axis, async_op=True)
        self._in_flight.append(u)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._finish(self._in_flight.pop(0))

    def _finish(self, u: Unit) -> None:
        """Wait for unit ``u``'s reduce-scatter; keep the data-parallel mean of this rank's segment."""
        seg = u.pending.wait()
        u.pending = None
        if self.axis.size > 1:
            seg.div_(self.axis.size)
        u.reduced = seg

    @torch.no_grad()
    def sync(self) -> None:
        """Finish the step's reduction: every shard gets the data-parallel mean of its rows'
        gradient (module docstring, step 3)."""
        self._armed = False
        for u in self.units:
            if u.pending is None and u.reduced is None:
                self._launch(u)
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        for u in self.units:
            seg = u.reduced
            for sp in u.params:
                rows = sp.stop - sp.start
                sp.shard.grad = seg[sp.offset:sp.offset + rows * sp.row_elems].view(rows, *sp.shape[1:])
            u.ready = 0
        self.free_all()                                # ZeRO-3: the root, and any layer that got no gradient

    @torch.no_grad()
    def after_step(self) -> None:
        """ZeRO-1/2: all-gather the updated rows so every data rank holds the whole block."""
        if self.stage == 3 or self.axis.size == 1:
            return
        for u in self.units:
            # padding rows are sent but never unpacked: no need to zero them
            send = torch.empty(u.segment, dtype=u.params[0].param.dtype, device=u.params[0].param.device)
            for sp in u.params:
                n = (sp.stop - sp.start) * sp.row_elems
                send[sp.offset:sp.offset + n].copy_(sp.shard.reshape(-1))
            full = C.all_gather(send, self.axis, dim=0)
            for sp in u.params:
                self._unpack_into(full, u, sp, sp.param.detach())

    def zero_grad(self) -> None:
        for u in self.units:
            u.reduced = None
            for sp in u.params:
                sp.param.grad = None
                sp.shard.grad = None

    # ---- what the optimizer, the norm and the checkpoint see -------------------------------
    def sharded(self) -> list:
        """Every :class:`ShardedParam`, units in order."""
        return [sp for u in self.units for sp in u.params]

    def named_shards(self) -> list:
        """(name, shard) of every parameter with at least one owned row."""
        return [(sp.name, sp.shard) for sp in self.sharded() if sp.stop > sp.start]

    @property
    def norm_axis(self):
        """The norm of the shards is summed over data ranks too (each row once)."""
        return self.axis

    def stepped(self) -> list:
        """Every shard as a :class:`SteppedTensor` (rows from ``start``), units in order."""
        return [SteppedTensor(sp.name, sp.param, sp.shard, sp.start) for sp in self.sharded()]

    def optimizer_tensors(self) -> list:
        return self.named_shards()

    def norm_tensors(self) -> list:
        """(shard, parameter) of every parameter with at least one owned row."""
        return [(sp.shard, sp.param) for sp in self.sharded() if sp.stop > sp.start]

    def memory_tensors(self) -> list:
        """The buffers ZeRO itself holds (ZeRO-3 flat shards, reduced gradient segments), for
        memory accounting; shards and their gradients are views into these or the parameters."""
        out = [u.flat_shard for u in self.units if u.flat_shard is not None]
        return out + [u.reduced for u in self.units if u.reduced is not None]


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    return obj


def offload_note(device: torch.device) -> Optional[str]:
    """The message for ``train.offload=optimizer`` on a CPU run (where it changes nothing)."""
    if device.type == "cpu":
        return ("train.offload=optimizer: this run is on the CPU, where the optimizer already lives in host "
                "memory; the setting changes nothing here (it moves AdamW's state and step to the CPU on GPUs)")
    return None


def warn_offload_on_cpu(device: torch.device, rank: int) -> None:
    note = offload_note(device)
    if note and rank == 0:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
