"""Data parallelism over ``mesh.data`` at every ZeRO stage: one class, :class:`ZeroDataParallel`,
the stage a number it reads in a few named places (:mod:`gridshard.zero.reducer` has the table).

Units and their flat buffers. Parameters are grouped into *units*, reduced (and at ZeRO-3
gathered and freed) together:

* ZeRO-0: *buckets* — consecutive trainable parameters of one (dtype, device), at most
  ``bucket_bytes`` of reduced gradient each (:func:`gridshard.theory.training.bucket_partition`);
* ZeRO-1/2/3: one unit per decoder layer (``layers.N`` / ``model.layers.N`` /
  ``vit.encoder.layer.N``: :mod:`gridshard.parallel.decoder_layers`) and one *root* unit with
  everything else (embedding, final norm, head; a tied weight once).

Each unit lays its parameters end to end in persistent flat buffers of L_u elements, padded to
a multiple of the unit's parts — D at ZeRO ≥ 1, whose data ranks own equal chunks, 1 at
ZeRO-0, whose every rank owns everything (:class:`~.flat_layout.FlatLayout`,
:mod:`gridshard.theory.zero`), set up once at construction:

* the *parameter buffer*: every parameter is a view of its slice (``p.data = buf[off:off+n]
  .view(shape)``, FSDP1's flat parameter);
* the *gradient buffer*: every ``.grad`` is a view of its slice, so autograd accumulates
  micro-batches straight into it (``grad += new``); :meth:`zero_grad` zeroes it in place and
  re-attaches any view something else replaced (``optimizer.zero_grad(set_to_none=True)``);
* the *reduced chunk* [C_u = L_u/parts]: this rank's chunk of the summed gradient, ÷ D —
  ZeRO ≥ 1: a reduce-scatter's output; ZeRO-0: the gradient buffer itself, all-reduced in place;
* ZeRO-3: the *parameter chunk* [C_u]: this rank's chunk of the parameters, which lives on
  while the parameter buffer's storage is freed.

Data rank r owns elements ``[r·C_u, (r+1)·C_u)`` of each unit (ZeRO-0: all of them). What the
optimizer steps (:class:`~.reducer.SteppedTensor`) is, per parameter, the part of that chunk
inside it: ZeRO ≥ 1 a 1-dim view of the parameter chunk (ZeRO-1/2: of the parameter buffer
itself), whose ``.grad`` is the same slice of the reduced chunk; parameters with no element in
the chunk are not stepped here. AdamW is element-wise, so stepping element ranges is exactly a
step of the whole model. ZeRO-0 steps each parameter whole.

Per rank between steps (fp32 runs; :func:`gridshard.theory.memory.model_state_bytes`):

====  ========================  ================================  ======================
ZeRO  parameters                gradients                         AdamW moments
====  ========================  ================================  ======================
0     buffer (full)             buffer (full) = reduced            full
1     buffer (full)             buffer (full) + reduced chunk     chunk
2     buffer (full)             reduced chunk (buffer freed)      chunk
3     chunk (buffer freed)      reduced chunk (buffer freed)      chunk
====  ========================  ================================  ======================

At ZeRO-0 with D = 1 in fp32 nothing is reduced, so there is no gradient buffer: the gradients
are autograd's own (no zeroing pass, no in-place add on the first micro-batch; :meth:`zero_grad`
drops them, as a plain loop does) and :meth:`sync` only gives a parameter without a gradient zeros.

bf16 storage (``param_dtype`` bf16, ``train.precision: bf16``): the parameter and gradient
buffers (and ZeRO-3's parameter chunk) are bf16; each unit also holds its *master chunk* [C_u]
fp32 (ZeRO-0: the whole unit), copied from the fp32 values before the parameters are cast —
that is what the optimizer steps, its ``.grad`` the fp32 reduced chunk. ``grad_reduce_dtype``
fp32: ZeRO-0 casts each bucket into its fp32 reduced buffer and all-reduces that in place;
ZeRO ≥ 1 reduce-scatters an fp32 cast of the gradient buffer (alive while in flight). bf16: the
bf16 buffer is reduced (all-reduced in place; reduce-scattered into a bf16 chunk) and cast into
(or added to) the fp32 reduced chunk. ZeRO-0's reduced buffer exists from the reduction to
:meth:`after_step`, and a bucket's bf16 gradient buffer is freed as soon as the bucket is in it
(given its storage back, for the next step, in :meth:`after_step`): per parameter between steps
2 (param) + 2 (grad) + 4 (master) + 8 (moments) = 16 bytes, from the reduction to the step
2 + 4 + 4 (reduced) + 8 = 18. :meth:`after_step` first copies each master chunk into the bf16
parameter chunk, so the all-gathers (and ZeRO-3's gathers) move bf16.

bf16 storage with A > 1 micro-batches (ZeRO-0/1 with ``overlap``: P = 1, D > 1): the micro-batches
are summed in fp32, as ZeRO-2/3's sharded accumulation and Megatron's fp32 main gradient do, not
by autograd's ``grad += new`` in bf16. When a unit's gradients of a micro-batch before the last
are complete (the post-accumulate-grad hooks count them; the reducer is not yet armed), they
are added into the unit's fp32 *accumulator* [L_u] (the first one copied) and the bf16 gradient
buffer is zeroed for the next micro-batch — ZeRO-0: the accumulator is the bucket's fp32 reduced
buffer, given its storage at the first micro-batch instead of at the reduction; ZeRO-1: a
separate [L_u] fp32 buffer, freed once reduced. The last micro-batch's reduction adds the bf16
buffer into it and reduces the sum: with an fp32 reduce, ZeRO-0 all-reduces the reduced buffer
in place, ZeRO-1 reduce-scatters the accumulator itself (no separate fp32 cast); with
``grad_reduce_dtype`` bf16 the fp32 sum is cast once into the bf16 gradient buffer and that is
reduced as with one micro-batch (one bf16 rounding of each rank's sum, where ZeRO-2/3 round each
micro-batch's reduce-scatter). Per parameter during the backward of micro-batches 2..A: + 4 bytes
(ZeRO-0: 2 + 2 + 4 + 4 + 8 = 20, then 18 from the reduction to the step;
:func:`gridshard.theory.memory.zero_accumulator_bytes`). One micro-batch is unchanged (no
accumulator, the same bytes and values). At D = 1 and without overlap (ZeRO-0/1 with a pipeline,
``train.overlap_grad_reduce=false``, the ``zero_bubble`` schedule) no hook runs and every stage
sums the micro-batches in its bf16 gradient buffer (ZeRO-2/3 too: no sharded accumulation there).

One step, ``A`` micro-batches:

1. backward of every micro-batch accumulates into the gradient buffers (bf16 ZeRO-0/1 with
   A > 1: into the fp32 accumulator, above; ZeRO-2/3 allocate a
   unit's buffer — ``untyped_storage().resize_`` and zero; ZeRO-3 with host pages: its released
   mapping, which reads zeros — when its backward starts: a hook
   on each parameter's gradient runs before autograd accumulates it);
2. the moment a unit's gradients are complete (a post-accumulate-grad hook counts them), its
   reduction is issued asynchronously — ZeRO-0 one in-place ``all_reduce`` of the bucket,
   ZeRO ≥ 1 one ``reduce_scatter`` of the unit's gradient buffer into its reduced chunk; no
   packing, buffers and chunks are contiguous — in the last micro-batch's backward (ZeRO-0/1,
   after :meth:`arm`), in *every* micro-batch's (ZeRO-2/3: *sharded accumulation*, a later
   micro-batch's result is added into the chunk, so no full gradient survives between
   micro-batches; also with pipeline stages, whose schedule runs each micro-batch's backward
   through ``torch.autograd.backward``, but not ``zero_bubble``, whose weight pass bypasses the
   hooks: :func:`gridshard.theory.zero.sharded_accumulation`); without ``overlap`` (ZeRO-0/1
   with a pipeline, ``zero_bubble``, or ``train.overlap_grad_reduce=false``) once, after the
   last backward. With ``defer_root`` (a pipeline stage holding a tied embedding's copy) the
   root unit is reduced in :meth:`sync` only, after
   :class:`gridshard.pipeline.tied.TiedEmbeddingSync` summed the copies' whole gradients.
   ZeRO ≥ 1 keep at most ``MAX_IN_FLIGHT`` outstanding
   (launching another first waits for the oldest) and free a gradient buffer's storage once
   its reduce-scatter is done (ZeRO-2/3; a new gradient for the unit first finishes a
   reduce-scatter still in flight). Every data rank runs the same graph, so the units
   complete, and their collectives are issued, in the same order on every rank;
3. :meth:`sync` issues what is still pending, waits for the rest, divides by D (the sum over
   data ranks and micro-batches → the mean) and hands each stepped tensor its slice of the
   reduced chunk as ``.grad``;
4. clipping and AdamW act on the stepped tensors (ZeRO ≥ 1: the norm counts each element once,
   sum of squares over tensor *and* data ranks: ``norm_axis``);
5. :meth:`after_step` (ZeRO-1/2): one in-place ``all_gather`` per unit of the parameter
   buffer from this rank's chunk of it (all issued, then all waited for) — the parameters
   are views, nothing to unpack.

ZeRO-3 parameters. Between uses a unit's parameter buffer is *released*: storage size 0, or
with host pages (``train.zero3_host_memory: pages``, a Linux CPU) its own mapping with its
pages handed back (:class:`~.pages.FlatPages`; the unit's ``gathered`` flag says which, and
:meth:`released_tensors` lets memory accounting count it 0). The parameter objects, their
names and autograd identity stay; every view sees the memory when it is back. With host pages
the long-lived chunks (parameter, reduced, master) and AdamW's moments of them are views of one
arena mapping (:class:`~.pages.ChunkArena`, :meth:`adam_moments`), and gloo's all-gather and
reduce-scatter transients are slots of a resident pool the reducer owns
(:class:`~.pages.StagingPool`: 2 gathers and ``MAX_IN_FLIGHT + 1`` reductions): glibc's heap
then holds only a step's activations (docs/memory.md "Resident memory on CPU"). A forward
pre-hook on the unit's module gathers it (memory back, one all-gather of
the parameter chunks into the buffer); after the forward the layer is freed again; an
identity autograd function on the layer's outputs gathers it again when backward reaches the
layer (the saved activations refer to the same storage, so they see the same values; the
parameters' version counters are their own, not the buffer's, so the write does not trip
autograd's saved-tensor check); when the layer's gradients are complete it is freed. The root
unit stays gathered from its first use in forward to the step's reduction (:meth:`sync`): the
head is the first thing every backward needs and the embedding the first thing every forward
needs. With ``train.recompute=full`` the recomputation runs inside the layer's backward,
after the regather.

ZeRO-3 prefetch (with ``overlap``: ``train.overlap_grad_reduce`` at D > 1, P = 1 or a pipeline
schedule with sharded accumulation). When a
unit's gather starts a use of it, the gather of the unit that runs next is issued
asynchronously — in forward the next layer (the root's first use issues layer 0's), in
backward the previous layer — and waited for by that unit's own hook; at most one unit ahead,
so at most two decoder layers are gathered at once (+ the root). The collectives, their order
and the values are those without prefetch (``tests/test_zero.py``); only the order against
the computation changes.

Communication per step and rank (payloads as the ledger records them, S_u = L_u elements,
4 bytes each):

* ZeRO-0: one all-reduce of each bucket (:func:`gridshard.theory.training.dp_gradient_allreduce`);
* ZeRO-1/2: one reduce-scatter of S_u (ZeRO-2 with sharded accumulation: one per micro-batch)
  and one all-gather of S_u per unit — on a ring (D−1)/D·S_u each, together the wire bytes of
  the all-reduce they replace (up to padding; :func:`gridshard.theory.zero.zero_step_comm`);
* ZeRO-3: one reduce-scatter per unit (per micro-batch with sharded accumulation), two
  all-gathers per decoder layer and micro-batch (forward and backward) and one per step for
  the root unit — with one micro-batch 1.5× the all-reduce's wire bytes.

Tensor-parallel partial gradients (``shard_spec.partial_grad_axes``, e.g. sequence-parallel
norm weights) are already reduced inside their layers (:mod:`gridshard.nn.norm`); this module
does not touch the tensor group.

Why our own and not FSDP2 / ``ZeroRedundancyOptimizer``: (1) a shard here is a few *boxes of
the canonical tensor* (an element range of a tensor-parallel block is a partial row, whole
rows and a partial row, :func:`gridshard.theory.zero.flat_range_boxes`, including the 2D norm
pieces and the kv blocks replicated over T/kv that DTensor placements cannot describe), which
the checkpoint planner writes as chunks — so checkpoints reshard between ZeRO stages, data
sizes and tensor layouts by overlap alone, with no gather at save time;
``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (its state is not a box of
anything a different D can read) and FSDP2 drops the tensor-parallel layout attributes of
plain-tensor parameters; (2) every collective goes through :mod:`gridshard.comm.collectives`
and is in the ledger, so the step's bytes are asserted against the formula; (3) the
reduction is an explicit sum then ÷D, which sidesteps FSDP2's reported averaging trap on
gloo (pytorch #162338); (4) the pipeline runner and the tied-embedding sync work on plain
``p.grad`` (views) until :meth:`sync`, unchanged.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..comm import collectives as C
from ..parallel.decoder_layers import decoder_layers
from ..theory.training import bucket_partition
from .flat_layout import FlatLayout
from .pages import ChunkArena, FlatPages, StagingPool, heap_trimmer, mappable
from .reducer import SteppedTensor, whole_parameters

MAX_IN_FLIGHT = 2          # ZeRO ≥ 1: reduce-scatters outstanding in backward; the oldest is waited for beyond it


@dataclass
class Unit:
    """Parameters reduced (and gathered, freed) together — a ZeRO-0 bucket, a decoder layer or the
    root — and their flat buffers (module docstring)."""

    name: str
    names: list
    params: list
    modules: list = field(default_factory=list)
    layout: Optional[FlatLayout] = None
    param_buffer: Optional[torch.Tensor] = None     # [L]: the parameters are views of it
    param_chunk: Optional[torch.Tensor] = None      # [C]: this rank's chunk (ZeRO ≤ 2: a view of param_buffer)
    grad_buffer: Optional[torch.Tensor] = None      # [L]: the .grad are views of it
    grad_views: list = field(default_factory=list)
    reduced: Optional[torch.Tensor] = None          # [C]: the reduced gradient chunk, ÷ D (ZeRO-0 fp32: grad_buffer)
    stepped: list = field(default_factory=list)     # SteppedTensor per parameter with elements in the chunk
    ready: int = 0                                  # gradients accumulated in the current backward
    pending: object = None                          # PendingCollective of the reduction in flight
    scratch: Optional[torch.Tensor] = None          # [C]: a reduce-scatter output added (or copied) into reduced
    scratch_first: bool = False                     # the scratch holds the step's first reduction: copied
    master: Optional[torch.Tensor] = None           # [C] fp32: bf16 storage's master chunk (what is stepped)
    send: Optional[torch.Tensor] = None             # the tensor being reduced while in flight
    reductions: int = 0                             # reductions issued this step
    unreduced: bool = False                         # the gradient buffer holds gradients not yet reduced
    grads_live: bool = True                         # the gradient buffer has its storage
    gathered: bool = True
    prefetch: object = None                         # ZeRO-3: PendingCollective of a gather issued ahead
    accum: Optional[torch.Tensor] = None            # [L] fp32: bf16 ZeRO-0/1's micro-batch sum (ZeRO-0: reduced)
    accumulated: bool = False                       # accum holds earlier micro-batches' gradients of this step
    param_pages: Optional[FlatPages] = None         # ZeRO-3: param_buffer's memory, released between uses
    grad_pages: Optional[FlatPages] = None          # ZeRO-3: grad_buffer's memory, released once reduced
    moments: tuple = ()                             # ZeRO-3 host pages: AdamW's [C] exp_avg, exp_avg_sq (arena views)
    send_slot: Optional[tuple] = None               # ZeRO-3 host pages: the all-gather's StagingPool slot
    recv_slot: Optional[tuple] = None               # ZeRO-3 host pages: the reduce-scatter's StagingPool slot

    @property
    def nbytes(self) -> int:
        return self.layout.padded * self.params[0].element_size()


class _RegatherInBackward(torch.autograd.Function):
    """Identity on a layer's output whose backward gathers the layer's parameters (ZeRO-3):
    backward reaches a layer's outputs before anything inside the layer."""

    @staticmethod
    def forward(ctx, x, zero, unit):
        ctx.zero, ctx.unit = zero, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.zero.gather(ctx.unit, ahead=-1)
        return grad, None, None


class ZeroDataParallel:
    """ZeRO stage ``stage`` (0–3) of ``model`` (laid out by :func:`gridshard.parallelize`) over
    ``data_axis`` (a :class:`gridshard.mesh.Axis`; module docstring). ``bucket_bytes``: ZeRO-0's
    bucket size. ``overlap``: issue each unit's reduction in the backward as soon as its
    gradients are complete; ``defer_root``: not the root unit's (:meth:`_shards_now`).
    ``host_pages`` (``train.zero3_host_memory: pages``; ZeRO-3 on a Linux CPU, else no effect):
    ZeRO-3's own memory outside glibc's heap (:mod:`gridshard.zero.pages`)."""

    def __init__(self, model: nn.Module, data_axis, stage: int, bucket_bytes: int = 25 << 20, overlap: bool = True,
                 param_dtype: torch.dtype = torch.float32, grad_reduce_dtype: torch.dtype = torch.float32,
                 defer_root: bool = False, host_pages: bool = False):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroDataParallel: stage {stage} is not 0, 1, 2 or 3. Fix: set train.zero to one of them")
        self.model, self.axis, self.stage = model, data_axis, stage
        self.param_dtype = param_dtype                 # bf16: fp32 master chunks (module docstring)
        self.mixed = param_dtype != torch.float32
        self.reduce_fp32 = not self.mixed or grad_reduce_dtype == torch.float32
        self.overlap = overlap and data_axis.size > 1
        # ZeRO-2/3 with overlap: reduce-scatter every micro-batch into the sharded accumulator
        self.sharded_accumulation = stage >= 2 and self.overlap
        # a pipeline's tied-embedding copy: the root is reduced in sync(), after the cross-stage sum
        self.defer_root = defer_root
        # ZeRO-0/1 under bf16 storage with overlap: add each earlier micro-batch into an fp32 accumulator
        self.fp32_accumulation = stage <= 1 and self.mixed and self.overlap
        # ZeRO-0, D = 1, fp32: nothing to reduce, autograd's own gradients
        self.persistent = stage > 0 or data_axis.size > 1 or self.mixed
        self.parts, self.part = (data_axis.size, data_axis.rank) if stage else (1, 0)
        self.max_in_flight = MAX_IN_FLIGHT if stage else None
        self.units = self._build_units(model) if stage else self._bucket_units(model, bucket_bytes)
        # ZeRO-3 prefetch order: the root (embedding first), then the layers as the forward runs them
        self.gather_order = [u for u in self.units if u.name == "root"] + [u for u in self.units if u.name != "root"]
        self._armed = False
        self._in_flight: list = []                     # units whose reduction is outstanding, oldest first
        # ZeRO-3 host pages: chunks and AdamW moments in one mapping, staging slots (gridshard.zero.pages)
        device = next(model.parameters()).device
        self.host_pages = host_pages and stage == 3 and mappable(device)
        self.arena = self._plan_arena(device) if stage == 3 else None
        self.staging = self._staging_pool(device) if self.arena is not None else None
        self._moments: dict = {}                       # id(stepped tensor) → (exp_avg, exp_avg_sq) views
        for u in self.units:
            self._lay_out(u)
            for p in u.params:
                if self.overlap or stage == 3:
                    p.register_post_accumulate_grad_hook(self._on_grad(u))
                if stage >= 2:
                    p.register_hook(self._before_accumulate(u))
            self._free(u)                              # ZeRO-3: the chunk holds the values now
        if stage == 3:
            self._install_gather_hooks()
            trim = heap_trimmer(device) if self.host_pages else None
            if trim is not None:                       # the original parameters, freed above, leave the process
                trim(0)
        model.grad_reducer = self                      # gathered_state_dict finds the shards through it

    # ---- construction ------------------------------------------------------------------
    def _bucket_units(self, model, bucket_bytes: int) -> list:
        """ZeRO-0: the trainable parameters by (dtype, device), in model order, cut into buckets of at
        most ``bucket_bytes`` of what is reduced (fp32 under bf16 storage with an fp32 reduce)."""
        groups: dict = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device), []).append((name, p))
        units = []
        for (dtype, _), named in groups.items():
            size = 4 if self.mixed and self.reduce_fp32 else (self.param_dtype if self.mixed else dtype).itemsize
            for idx in bucket_partition([p.numel() for _, p in named], size, bucket_bytes):
                units.append(Unit(f"bucket.{len(units)}", [named[i][0] for i in idx], [named[i][1] for i in idx]))
        return units

    def _build_units(self, model) -> list:
        """ZeRO ≥ 1: decoder-layer units in model order, then the root unit; each parameter once."""
        seen, units = set(), []

        def take(unit, named):
            for pname, p in named:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    unit.names.append(pname)
                    unit.params.append(p)
            if unit.params:
                units.append(unit)

        for lname, module in decoder_layers(model):
            take(Unit(lname, [], [], modules=[module]), module.named_parameters(prefix=lname))
        take(Unit("root", [], []), model.named_parameters())
        for u in units:
            if len({p.dtype for p in u.params}) > 1:
                dtypes = sorted({str(p.dtype) for p in u.params})
                raise ValueError(f"ZeRO: unit {u.name} mixes parameter dtypes {dtypes}. "
                                 "Fix: keep the parameters in one dtype")
            if u.name == "root":                       # modules that own root parameters directly
                ids = {id(p) for p in u.params}
                u.modules = [m for m in model.modules() if any(id(p) in ids for p in m.parameters(recurse=False))]
        return units

    def _chunk_pieces(self, u: Unit) -> list:
        """ZeRO-3: (numel, dtype) of ``u``'s long-lived chunks in arena order — parameter chunk,
        reduced chunk, fp32 master (bf16 storage), AdamW's two moments of the stepped chunk."""
        c, stored = u.layout.padded // self.parts, self._stored_dtype(u)
        stepped = torch.float32 if self.mixed else stored
        return [(c, stored), (c, torch.float32)] + ([(c, torch.float32)] if self.mixed else []) + [(c, stepped)] * 2

    def _stored_dtype(self, u: Unit) -> torch.dtype:
        """The dtype ``u``'s parameters are stored in (bf16 storage: ``param_dtype``)."""
        return self.param_dtype if self.mixed else u.params[0].dtype

    def _plan_arena(self, device) -> Optional[ChunkArena]:
        """ZeRO-3: every unit's layout, and with host pages the arena sized for all their chunks."""
        for u in self.units:
            u.layout = FlatLayout.of([p.numel() for p in u.params], self.parts)
        if not self.host_pages:
            return None
        return ChunkArena.on(device, [piece for u in self.units for piece in self._chunk_pieces(u)])

    def _staging_pool(self, device) -> Optional[StagingPool]:
        """ZeRO-3 host pages at D > 1: 2 send and ``MAX_IN_FLIGHT + 1`` receive slots of the
        largest unit in fp32 (:class:`~.pages.StagingPool`)."""
        if self.axis.size == 1:
            return None
        nbytes = 4 * max(u.layout.padded for u in self.units)
        return StagingPool(nbytes, device, gathers=2, reductions=MAX_IN_FLIGHT + 1)

    def _new_chunk(self, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A zero [n] chunk: carved from the arena (ZeRO-3 host pages), else its own tensor."""
        return self.arena.take(n, dtype) if self.arena is not None else torch.zeros(n, dtype=dtype, device=device)

    @torch.no_grad()
    def _lay_out_zero3(self, u: Unit, shapes) -> None:
        """ZeRO-3: ``u``'s parameter and gradient buffers as :class:`~.pages.FlatPages`, its chunks
        carved from the arena in :meth:`_chunk_pieces` order (zeros), the values copied in."""
        first, stored, (lo, hi) = u.params[0], self._stored_dtype(u), u.layout.chunk(self.part)
        chunk = lambda dtype: self._new_chunk(hi - lo, dtype, first.device)                 # noqa: E731
        u.param_pages = FlatPages(u.layout.padded, stored, first.device, mapped=self.host_pages)
        u.grad_pages = FlatPages(u.layout.padded, stored, first.device, mapped=self.host_pages)
        values = (torch.zeros(u.layout.padded, dtype=first.dtype, device=first.device) if self.mixed
                  else u.param_pages.tensor)
        for p, view in zip(u.params, u.layout.views(values, shapes)):
            view.copy_(p.detach())
        u.param_chunk, u.reduced = chunk(stored), chunk(torch.float32)
        if self.mixed:                                 # the fp32 values → the master chunk, then bf16 storage
            u.master = chunk(torch.float32).copy_(values[lo:hi])
            u.param_pages.tensor.copy_(values)
        u.param_buffer, u.grad_buffer = u.param_pages.tensor, u.grad_pages.tensor
        u.param_chunk.copy_(u.param_buffer[lo:hi])
        stepped_dtype = torch.float32 if self.mixed else stored
        u.moments = (chunk(stepped_dtype), chunk(stepped_dtype)) if self.arena is not None else ()

    @torch.no_grad()
    def _lay_out(self, u: Unit) -> None:
        """Allocate ``u``'s buffers, make the parameters and gradients views of them and record
        what this rank steps (module docstring; ZeRO-3: :meth:`_lay_out_zero3`)."""
        first, shapes = u.params[0], [p.shape for p in u.params]
        u.layout = u.layout or FlatLayout.of([p.numel() for p in u.params], self.parts)
        new = lambda n, dtype=first.dtype: torch.zeros(n, dtype=dtype, device=first.device)     # noqa: E731
        lo, hi = u.layout.chunk(self.part)
        if self.stage == 3:
            self._lay_out_zero3(u, shapes)
        else:
            values = new(u.layout.padded)
            for p, view in zip(u.params, u.layout.views(values, shapes)):
                view.copy_(p.detach())
            if self.mixed:                             # the fp32 values → the master chunk, then bf16 storage
                u.master = values[lo:hi].clone()
                values = values.to(self.param_dtype)
            u.param_buffer, u.param_chunk = values, values[lo:hi]
            u.grad_buffer = new(u.layout.padded if self.persistent else 0, u.param_buffer.dtype)
        for p, view in zip(u.params, u.layout.views(u.param_buffer, shapes)):
            p.data = view
        u.grad_views = u.layout.views(u.grad_buffer, shapes) if self.persistent else []
        stepped = u.master if self.mixed else u.param_chunk
        if self.stage:
            u.reduced = u.reduced if self.stage == 3 else new(hi - lo, torch.float32)
            for name, p, off, (a, b) in zip(u.names, u.params, u.layout.offsets, u.layout.owned(self.part)):
                if b > a:
                    u.stepped.append(SteppedTensor(name, p, stepped[off + a - lo:off + b - lo], (a, b)))
                    if u.moments:                      # the optimizer's state for it (adam_moments)
                        self._moments[id(u.stepped[-1].tensor)] = tuple(m[off + a - lo:off + b - lo]
                                                                        for m in u.moments)
        else:                                          # whole parameters (bf16: their masters)
            u.reduced = new(u.layout.padded, torch.float32) if self.mixed else u.grad_buffer
            views = u.layout.views(stepped, shapes) if self.mixed else u.params
            u.stepped = [SteppedTensor(name, p, v) for name, p, v in zip(u.names, u.params, views)]
            if self.mixed:                             # storage from the reduction (accumulation) to after_step only
                u.reduced.untyped_storage().resize_(0)
                u.accum = u.reduced
        if self.stage == 1 and self.fp32_accumulation:     # storage from the first micro-batch to the reduction
            u.accum = torch.empty(u.layout.padded, dtype=torch.float32, device=first.device)
            u.accum.untyped_storage().resize_(0)
        if self.stage <= 1:
            if self.persistent:
                self._attach_grads(u)
        else:                                          # allocated when the unit's first backward starts
            self._release_grads(u)
            u.grads_live = False

    def _install_gather_hooks(self) -> None:
        for u in self.units:
            for module in u.modules:
                module.register_forward_pre_hook(self._pre_forward(u))
                if u.name != "root":
                    module.register_forward_hook(self._post_forward(u))

    def _pre_forward(self, u):
        def hook(_module, _args):
            # a forward inside backward (full recompute) finds its unit gathered: nothing to prefetch
            self.gather(u, ahead=1 if torch._C._current_graph_task_id() == -1 else 0)
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
    def gather(self, u: Unit, ahead: int = 0) -> None:
        """All-gather unit ``u``'s parameter chunks into its parameter buffer (no-op if gathered —
        always, below ZeRO-3; waited for if prefetched): every parameter, a view of the buffer,
        sees the whole values. ``ahead`` = ±1 (with ``overlap``): then issue, asynchronously,
        the gather of the unit that runs next — the next in forward (+1), the previous layer in
        backward (−1) — so it moves while this one computes; at most one unit ahead (issue 27's
        prefetch; the same collectives, in the same order on every rank, as without it)."""
        fresh = u.prefetch is not None or not u.gathered          # this call starts a use of u
        if u.prefetch is not None:
            self._wait_prefetch(u)
        elif not u.gathered:
            u.param_pages.restore()
            slot = self._take_slot("gather")
            C.all_gather_into(u.param_buffer, u.param_chunk, self.axis,
                              staging=self._slot_view(slot, u.param_buffer.dtype))
            self._give_slot(slot)
            u.gathered = True
        if ahead and fresh and self.overlap:
            i = self.gather_order.index(u) + ahead
            if 0 <= i < len(self.gather_order) and self.gather_order[i].name != "root":
                self._prefetch(self.gather_order[i])

    def _prefetch(self, u: Unit) -> None:
        if u.gathered or u.prefetch is not None:
            return
        u.param_pages.restore()
        u.send_slot = self._take_slot("gather")
        u.prefetch = C.all_gather_into(u.param_buffer, u.param_chunk, self.axis, async_op=True,
                                       staging=self._slot_view(u.send_slot, u.param_buffer.dtype))
        u.gathered = True

    def _wait_prefetch(self, u: Unit) -> None:
        u.prefetch.wait()
        u.prefetch = None
        self._give_slot(u.send_slot)
        u.send_slot = None

    def _take_slot(self, kind: str) -> Optional[tuple]:
        """A free slot of the staging pool (host pages at D > 1), else None: the collective allocates."""
        return self.staging.take(kind) if self.staging is not None else None

    def _slot_view(self, slot: Optional[tuple], dtype: torch.dtype) -> Optional[torch.Tensor]:
        return self.staging.view(slot, dtype) if slot is not None else None

    def _give_slot(self, slot: Optional[tuple]) -> None:
        if slot is not None:
            self.staging.give(slot)

    def _free(self, u: Unit) -> None:
        if self.stage != 3 or not u.gathered:
            return
        if u.prefetch is not None:                     # issued ahead but never used (e.g. a forward cut short)
            self._wait_prefetch(u)
        u.param_pages.release()
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
        """ZeRO-3: free every gathered unit (e.g. the root after an evaluation); no-op below."""
        for u in self.units:
            self._free(u)

    # ---- gradients -------------------------------------------------------------------------
    def _attach_grads(self, u: Unit) -> None:
        """Make every parameter's ``.grad`` its view of the gradient buffer (again, if replaced)."""
        for p, view in zip(u.params, u.grad_views):
            if p.grad is not view:
                p.grad = view

    @torch.no_grad()
    def _ensure_grad_buffer(self, u: Unit) -> None:
        """ZeRO-2/3: give ``u``'s gradient buffer its storage back, zeroed, before the first
        gradient of its backward is accumulated (a reduce-scatter of the previous micro-batch's
        still in flight is finished first: it frees the buffer)."""
        if u.pending is not None:
            self._in_flight.remove(u)
            self._finish(u)
        if not u.grads_live:
            if u.grad_pages is not None:
                u.grad_pages.restore(zero=True)
            else:
                u.grad_buffer.untyped_storage().resize_(u.nbytes)
                u.grad_buffer.zero_()
            u.grads_live = True
        self._attach_grads(u)

    def _before_accumulate(self, u: Unit):
        def hook(_grad):
            self._ensure_grad_buffer(u)
        return hook

    def _on_grad(self, u: Unit):
        def on_grad_ready(_param):
            u.unreduced = True
            u.ready += 1
            if u.ready < len(u.params):
                return
            u.ready = 0
            if (self._armed or self._shards_now(u)) and u.pending is None:
                self._launch(u)
            elif self.fp32_accumulation and not self._armed:
                self._accumulate(u)
            if self.stage == 3 and u.name != "root":
                self._free(u)
        return on_grad_ready

    def _shards_now(self, u: Unit) -> bool:
        """Sharded accumulation reduces ``u`` now, at the end of a micro-batch's backward: every
        unit but a deferred root (``defer_root``: ``sync()`` reduces it once the tied-embedding
        copies' whole gradients are summed across stages)."""
        return self.sharded_accumulation and not (self.defer_root and u.name == "root")

    def arm(self) -> None:
        """The next backward is the step's last: reduce each unit as soon as it is complete."""
        if self.overlap:
            self._armed = True
            for u in self.units:
                u.ready = 0

    @torch.no_grad()
    def _accumulate(self, u: Unit) -> None:
        """bf16 storage, ZeRO-0/1, a micro-batch before the last: add ``u``'s bf16 gradients into its
        fp32 accumulator (given its storage by the first) and zero the gradient buffer for the next."""
        if u.accumulated:
            u.accum.add_(u.grad_buffer)
        else:
            u.accum.untyped_storage().resize_(u.layout.padded * 4)
            u.accum.copy_(u.grad_buffer)
            u.accumulated = True
        u.grad_buffer.zero_()

    def _drop_accum(self, u: Unit) -> None:
        """The accumulator is consumed: ZeRO-1 frees its storage (ZeRO-0's is the reduced buffer)."""
        u.accumulated = False
        if u.accum is not None and u.accum is not u.reduced:
            u.accum.untyped_storage().resize_(0)

    @torch.no_grad()
    def _launch(self, u: Unit) -> None:
        """Issue ``u``'s reduction (ZeRO-0: an all-reduce, ZeRO ≥ 1: a reduce-scatter) asynchronously."""
        if not u.grads_live:                           # no gradient reached the unit this step
            self._ensure_grad_buffer(u)
        u.pending = self._all_reduce(u) if self.stage == 0 else self._reduce_scatter(u)
        u.reductions, u.unreduced = u.reductions + 1, False
        if self.stage >= 2:
            for p in u.params:
                p.grad = None                          # the buffer is freed once reduced
        self._in_flight.append(u)
        while self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
            self._finish(self._in_flight.pop(0))

    def _all_reduce(self, u: Unit):
        """ZeRO-0: the bucket's in-place all-reduce — of the gradient buffer, or under bf16 storage
        with an fp32 reduce of its fp32 cast in the reduced buffer."""
        u.send = u.grad_buffer
        if self.mixed and self.reduce_fp32:
            u.send = self._cast_into_reduced(u)
        elif u.accumulated:                            # bf16 reduce: the fp32 sum of the micro-batches, cast once
            u.grad_buffer.copy_(u.accum.add_(u.grad_buffer))
            self._drop_accum(u)
        return C.all_reduce(u.send, self.axis, async_op=True, inplace=True)

    def _cast_into_reduced(self, u: Unit) -> torch.Tensor:
        """ZeRO-0 under bf16 storage: the bucket's fp32 reduced buffer gets its storage and the
        bf16 gradients, whose buffer is freed (what keeps the step at 18 bytes per parameter)."""
        if u.accumulated:                              # the reduced buffer is the accumulator: the last micro-batch
            u.reduced.add_(u.grad_buffer)
            u.accumulated = False
        else:
            u.reduced.untyped_storage().resize_(u.reduced.numel() * u.reduced.element_size())
            u.reduced.copy_(u.grad_buffer)
        self._free_grad_buffer(u)
        return u.reduced

    def _reduce_scatter(self, u: Unit):
        """ZeRO ≥ 1: reduce-scatter ``u``'s gradient buffer, the step's first into the reduced chunk,
        a later micro-batch's (sharded accumulation) into a scratch chunk added to it when done."""
        send = u.grad_buffer
        if u.accumulated:                              # bf16 ZeRO-1, A > 1: the last micro-batch into the fp32 sum
            u.accum.add_(u.grad_buffer)
            if self.reduce_fp32:
                send = u.send = u.accum                # reduced as it is, freed when done
            else:                                      # cast once, reduced in bf16
                u.grad_buffer.copy_(u.accum)
                self._drop_accum(u)
        elif self.mixed and self.reduce_fp32:          # bf16 storage, fp32 reduce: a transient fp32 cast
            send = u.send = u.grad_buffer.float()
        out = u.reduced
        if u.reductions or send.dtype != out.dtype:
            out = u.scratch = torch.empty(out.numel(), dtype=send.dtype, device=out.device)
            u.scratch_first = not u.reductions
        u.recv_slot = self._take_slot("reduce")
        return C.reduce_scatter_flat(send, self.axis, async_op=True, out=out,
                                     staging=self._slot_view(u.recv_slot, send.dtype))

    def _free_grad_buffer(self, u: Unit) -> None:
        """Release ``u``'s gradient buffer's storage (its ``.grad`` views dropped)."""
        for p in u.params:
            p.grad = None
        self._release_grads(u)
        u.grads_live = False

    def _release_grads(self, u: Unit) -> None:
        if u.grad_pages is not None:                   # ZeRO-3 (gridshard.zero.pages)
            u.grad_pages.release()
        else:
            u.grad_buffer.untyped_storage().resize_(0)

    def _finish(self, u: Unit) -> None:
        """Wait for unit ``u``'s reduction; ZeRO-0 bf16 reduce: cast it into the reduced buffer;
        ZeRO ≥ 1: add a later micro-batch's into the reduced chunk (ZeRO-2/3: free the gradient buffer)."""
        u.pending.wait()
        self._give_slot(u.recv_slot)
        u.recv_slot = None
        if u.send is u.grad_buffer and u.reduced is not u.grad_buffer:
            self._cast_into_reduced(u)
        if u.send is not None and u.send is u.accum:
            self._drop_accum(u)
        u.pending, u.send = None, None
        if u.scratch is not None:
            (u.reduced.copy_ if u.scratch_first else u.reduced.add_)(u.scratch)
            u.scratch = None
        if self.stage >= 2:
            self._free_grad_buffer(u)

    @torch.no_grad()
    def sync(self) -> None:
        """Finish the step's reduction: every stepped tensor gets the data-parallel mean of its
        elements' gradient (module docstring, step 3; ZeRO-0 at D = 1 in fp32: a parameter without
        a gradient gets zeros, as every parameter has one at D > 1, so AdamW steps it alike)."""
        self._armed = False
        if not self.persistent:
            for p in (p for u in self.units for p in u.params):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        for u in self.units:
            if u.pending is None and (u.unreduced or not u.reductions):
                self._launch(u)
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        for u in self.units:
            if self.axis.size > 1:
                u.reduced.div_(self.axis.size)         # the sum over data ranks (and micro-batches) → mean
            self._hand_grads(u)
            u.ready = 0
        self.free_all()                                # ZeRO-3: the root, and any layer that got no gradient

    def _hand_grads(self, u: Unit) -> None:
        """Each stepped tensor's ``.grad``: its slice of the reduced chunk (ZeRO-0 fp32: the
        parameters' own ``.grad`` already are)."""
        if self.stage:
            lo = u.layout.chunk(self.part)[0]
            where = {id(p): off for p, off in zip(u.params, u.layout.offsets)}
            for s in u.stepped:
                a, b = s.elements
                s.tensor.grad = u.reduced[where[id(s.param)] + a - lo:where[id(s.param)] + b - lo]
        elif self.mixed:
            for s, g in zip(u.stepped, u.layout.views(u.reduced, [p.shape for p in u.params])):
                s.tensor.grad = g

    @torch.no_grad()
    def after_step(self) -> None:
        """bf16 storage: copy every master chunk into the bf16 parameter chunk (ZeRO ≤ 2: this
        rank's chunk of the parameter buffer; ZeRO-3: the parameter chunk); ZeRO-0 frees the
        reduced buffers and gives the gradient buffers their storage back. ZeRO-1/2: all-gather
        every unit's updated chunk into its parameter buffer, in place."""
        if self.mixed:
            for u in self.units:
                u.param_chunk.copy_(u.master)
            self._end_reduction()
        if self.stage not in (1, 2) or self.axis.size == 1:
            return
        pending = [C.all_gather_into(u.param_buffer, u.param_chunk, self.axis, async_op=True) for u in self.units]
        for work in pending:
            work.wait()

    def _end_reduction(self) -> None:
        """ZeRO-0 under bf16 storage: free the reduced buffers and give the gradient buffers their
        storage back (zeroed and re-attached by :meth:`zero_grad`); no-op once done."""
        if self.stage or not self.mixed:
            return
        for u in self.units:
            for s in u.stepped:
                s.tensor.grad = None
            u.reduced.untyped_storage().resize_(0)
            if not u.grads_live:
                u.grad_buffer.untyped_storage().resize_(u.nbytes)
                u.grads_live = True

    def zero_grad(self) -> None:
        """Zero the gradient buffers that have storage (ZeRO-0/1: all, persistent; ZeRO-2/3 get
        theirs back, zeroed, when the unit's backward starts) and drop the stepped tensors'
        gradients (ZeRO-0, D = 1, fp32: drop autograd's gradients)."""
        self._end_reduction()                          # a skipped step has no after_step
        for u in self.units:
            u.reductions, u.unreduced = 0, False
            if u.accumulated:                          # a step abandoned before its reduction
                self._drop_accum(u)
            if not self.persistent:
                for p in u.params:
                    p.grad = None
            elif u.grads_live:
                u.grad_buffer.zero_()
                self._attach_grads(u)
            for s in u.stepped:
                if s.tensor is not s.param:
                    s.tensor.grad = None

    # ---- what the optimizer, the norm and the checkpoint see -------------------------------
    @property
    def norm_axis(self):
        """ZeRO ≥ 1: the norm of the stepped elements is summed over data ranks too (each element
        once); ZeRO-0: None, every rank holds whole gradients."""
        return self.axis if self.stage else None

    def stepped(self) -> list:
        """Every :class:`SteppedTensor` (checkpoint blocks; tied weights once): ZeRO ≥ 1 the
        parameters with elements in this rank's chunks, units in order; ZeRO-0 every parameter of
        the model, frozen ones too, in model order."""
        if self.stage:
            return [s for u in self.units for s in u.stepped]
        mine = {id(s.param): s for u in self.units for s in u.stepped}
        return [mine.get(id(s.param), s) for s in whole_parameters(self.model)]

    def optimizer_tensors(self) -> list:
        """(name, tensor) pairs the optimizer steps."""
        return [(s.name, s.tensor) for u in self.units for s in u.stepped]

    def norm_tensors(self) -> list:
        """(stepped tensor, its parameter) pairs whose gradients the global norm and clipping act on."""
        return [(s.tensor, s.param) for u in self.units for s in u.stepped]

    def memory_tensors(self) -> list:
        """The buffers held beyond the parameters and their ``.grad`` (reduced chunks, gradient
        buffers with no ``.grad`` attached, masters, ZeRO-3 parameter chunks), for memory
        accounting; stepped tensors and their gradients are views into these."""
        out = [u.reduced for u in self.units] + [u.grad_buffer for u in self.units]
        out += [u.master for u in self.units] if self.mixed else []
        out += [u.accum for u in self.units] if self.stage == 1 and self.fp32_accumulation else []
        return out + ([u.param_chunk for u in self.units] if self.stage == 3 else [])

    def released_tensors(self) -> list:
        """The buffers whose memory is released now — ZeRO-3 parameter buffers of units not
        gathered, gradient buffers without their memory — which memory accounting counts as 0
        bytes (:func:`gridshard.engine.memory_meter.model_state_tensor_bytes`): a released
        mapping keeps its storage's size (:mod:`gridshard.zero.pages`)."""
        out = [u.param_buffer for u in self.units if u.param_pages is not None and not u.gathered]
        return out + [u.grad_buffer for u in self.units if u.grad_pages is not None and not u.grads_live]

    def adam_moments(self, tensor: torch.Tensor) -> Optional[tuple]:
        """(exp_avg, exp_avg_sq) for a stepped ``tensor``: its slices of the unit's moment chunks
        in the arena (ZeRO-3 host pages, :mod:`gridshard.zero.pages`), else None."""
        return self._moments.get(id(tensor))


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
