"""Units and their flat buffers (:class:`Unit`, :class:`UnitLayout`). Parameters are grouped into
*units*, reduced (and at ZeRO-3 gathered and freed) together:

* ZeRO-0: *buckets* — consecutive trainable parameters of one (dtype, device), at most
  ``bucket_bytes`` of reduced gradient each (:func:`gridshard.theory.training.bucket_partition`);
* ZeRO-1/2/3: one unit per decoder layer (``layers.N`` / ``model.layers.N`` /
  ``vit.encoder.layer.N``: :mod:`gridshard.parallel.decoder_layers`) and one *root* unit with
  everything else (embedding, final norm, head; a tied weight once).

Each unit is reduced over its own ``axis``: the reducer's data axis (``mesh.data_context``, R ranks),
or for an MoE layer's experts split over E expert ranks (:mod:`gridshard.mesh_expert`) the
``expert_data`` axis (R/E ranks holding the same experts): those parameters form units of their own
(ZeRO ≥ 1: ``layers.N.experts`` after ``layers.N``; ZeRO-0: buckets of their own). Either way the
sum is divided by R: an expert's gradient sums the contributions of the tokens of all R ranks
(those of its E-rank block arrive through the dispatch), so ÷R is the data mean for it too.

Each unit lays its parameters end to end in persistent flat buffers of L_u elements, padded to
a multiple of the unit's parts — D at ZeRO ≥ 1, whose data ranks own equal chunks, 1 at
ZeRO-0, whose every rank owns everything (:class:`~.flat_layout.FlatLayout`,
:mod:`gridshard.theory.zero`), set up once at construction:

* the *parameter buffer*: every parameter is a view of its slice (``p.data = buf[off:off+n]
  .view(shape)``, FSDP1's flat parameter);
* the *gradient buffer*: every ``.grad`` is a view of its slice, so autograd accumulates
  micro-batches straight into it (``grad += new``); :meth:`~.reduction.GradientReduction.zero_grad`
  zeroes it in place and re-attaches any view something else replaced
  (``optimizer.zero_grad(set_to_none=True)``);
* the *reduced chunk* [C_u = L_u/parts]: this rank's chunk of the summed gradient, ÷ D —
  ZeRO ≥ 1: a reduce-scatter's output; ZeRO-0: the gradient buffer itself, all-reduced in place;
* ZeRO-3: the *parameter chunk* [C_u]: this rank's chunk of the parameters, which lives on
  while the parameter buffer's storage is freed — under bf16 storage the fp32 master chunk
  itself (no bf16 copy: a gather casts it into the buffer's own slice, then all-gathers bf16).

Data rank r owns elements ``[r·C_u, (r+1)·C_u)`` of each unit (ZeRO-0: all of them). What the
optimizer steps (:class:`~.stepped.SteppedTensor`) is, per parameter, the part of that chunk
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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..nn.sharding import expert_split, get_spec
from ..parallel.decoder_layers import decoder_layers
from ..theory.training import bucket_partition
from .flat_layout import FlatLayout
from .pages import ChunkArena, FlatPages
from .settings import ReadsSettings, ZeroSettings
from .stepped import SteppedTensor


@dataclass
class Unit:
    """Parameters reduced (and gathered, freed) together — a ZeRO-0 bucket, a decoder layer or the
    root — and their flat buffers (module docstring)."""

    name: str
    names: list
    params: list
    modules: list = field(default_factory=list)
    axis: object = None                             # the Axis the gradients are reduced over (module docstring)
    parts: int = 1                                  # ZeRO ≥ 1: axis.size ranks own equal chunks; ZeRO-0: 1
    part: int = 0                                   # this rank's chunk
    layout: Optional[FlatLayout] = None
    param_buffer: Optional[torch.Tensor] = None     # [L]: the parameters are views of it
    param_chunk: Optional[torch.Tensor] = None      # [C]: this rank's chunk (ZeRO ≤ 2: a view of param_buffer;
                                                    # ZeRO-3 bf16 storage: the fp32 master itself)
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

    def attach_grads(self) -> None:
        """Make every parameter's ``.grad`` its view of the gradient buffer (again, if replaced)."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is not view:
                p.grad = view

    def release_grads(self) -> None:
        """Hand the gradient buffer's memory back: a released mapping (ZeRO-3, :mod:`.pages`) or
        storage size 0."""
        if self.grad_pages is not None:                # ZeRO-3 (gridshard.zero.pages)
            self.grad_pages.release()
        else:
            self.grad_buffer.untyped_storage().resize_(0)


class UnitLayout(ReadsSettings):
    """Builds a reducer's units and lays each out in its flat buffers (module docstring) under
    ``settings``; ``host_pages``: ZeRO-3's buffers as :class:`~.pages.FlatPages` mappings and its
    chunks carved from one :class:`~.pages.ChunkArena` (``arena``, :meth:`plan_arena`). ``moments``:
    id(stepped tensor) → its (exp_avg, exp_avg_sq) arena views, filled by :meth:`lay_out`."""

    def __init__(self, settings: ZeroSettings, host_pages: bool, axis, expert_axis=None):
        self.settings, self.host_pages, self.axis, self.expert_axis = settings, host_pages, axis, expert_axis
        self.arena: Optional[ChunkArena] = None
        self.moments: dict = {}

    def units(self, model, bucket_bytes: int) -> list:
        """The units of ``model``: ZeRO-0 buckets, ZeRO ≥ 1 decoder layers and the root, each with
        its reduction axis and its parts."""
        units = self.layer_units(model) if self.stage else self.bucket_units(model, bucket_bytes)
        for u in units:
            u.axis = u.axis or self.axis
            u.parts, u.part = (u.axis.size, u.axis.rank) if self.stage else (1, 0)
        return units

    def _by_expert(self, p) -> bool:
        """Whether ``p`` is reduced over the expert-data axis (its spec splits it over the experts)."""
        return self.expert_axis is not None and expert_split(get_spec(p))

    def bucket_units(self, model, bucket_bytes: int) -> list:
        """ZeRO-0: the trainable parameters by (dtype, device), in model order, cut into buckets of at
        most ``bucket_bytes`` of what is reduced (fp32 under bf16 storage with an fp32 reduce)."""
        groups: dict = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device, self._by_expert(p)), []).append((name, p))
        units = []
        for (dtype, _, by_expert), named in groups.items():
            size = 4 if self.mixed and self.reduce_fp32 else (self.param_dtype if self.mixed else dtype).itemsize
            for idx in bucket_partition([p.numel() for _, p in named], size, bucket_bytes):
                units.append(Unit(f"bucket.{len(units)}", [named[i][0] for i in idx], [named[i][1] for i in idx],
                                  axis=self.expert_axis if by_expert else None))
        return units

    def layer_units(self, model) -> list:
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
            named = list(module.named_parameters(prefix=lname))
            take(Unit(lname, [], [], modules=[module]), [(n, p) for n, p in named if not self._by_expert(p)])
            experts = [m for m in module.modules() if any(self._by_expert(p) for p in m.parameters(recurse=False))]
            take(Unit(f"{lname}.experts", [], [], modules=experts, axis=self.expert_axis),
                 [(n, p) for n, p in named if self._by_expert(p)])
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
        """ZeRO-3: (numel, dtype) of ``u``'s long-lived chunks in arena order — parameter chunk
        (bf16 storage: the fp32 master itself, no bf16 copy), reduced chunk, AdamW's two moments
        of the stepped chunk."""
        c = u.layout.padded // u.parts
        stepped = torch.float32 if self.mixed else self._stored_dtype(u)
        return [(c, stepped), (c, torch.float32)] + [(c, stepped)] * 2

    def _stored_dtype(self, u: Unit) -> torch.dtype:
        """The dtype ``u``'s parameters are stored in (bf16 storage: ``param_dtype``)."""
        return self.param_dtype if self.mixed else u.params[0].dtype

    def plan_arena(self, units, device) -> Optional[ChunkArena]:
        """ZeRO-3: every unit's layout, and with host pages the arena sized for all their chunks."""
        for u in units:
            u.layout = FlatLayout.of([p.numel() for p in u.params], u.parts)
        if not self.host_pages:
            return None
        self.arena = ChunkArena.on(device, [piece for u in units for piece in self._chunk_pieces(u)])
        return self.arena

    @torch.no_grad()
    def _lay_out_zero3(self, u: Unit, shapes) -> None:
        """ZeRO-3: ``u``'s parameter and gradient buffers as :class:`~.pages.FlatPages`, its chunks
        carved from the arena in :meth:`_chunk_pieces` order (zeros), the values copied in. bf16
        storage: the parameter chunk *is* the fp32 master (FSDP2's sharded fp32 parameters under
        ``MixedPrecisionPolicy(param_dtype=bf16)``); a gather casts it into the buffer's own slice
        and all-gathers bf16 from there (:meth:`~.gather.ParameterGather._prefetch`)."""
        first, stored, (lo, hi) = u.params[0], self._stored_dtype(u), u.layout.chunk(u.part)
        # a zero [C] chunk: carved from the arena (host pages), else its own tensor
        chunk = lambda dtype: (self.arena.take(hi - lo, dtype) if self.arena is not None     # noqa: E731
                               else torch.zeros(hi - lo, dtype=dtype, device=first.device))
        u.param_pages = FlatPages(u.layout.padded, stored, first.device, mapped=self.host_pages)
        u.grad_pages = FlatPages(u.layout.padded, stored, first.device, mapped=self.host_pages)
        values = (torch.zeros(u.layout.padded, dtype=first.dtype, device=first.device) if self.mixed
                  else u.param_pages.tensor)
        for p, view in zip(u.params, u.layout.views(values, shapes)):
            view.copy_(p.detach())
        u.param_chunk, u.reduced = chunk(torch.float32 if self.mixed else stored), chunk(torch.float32)
        u.param_buffer, u.grad_buffer = u.param_pages.tensor, u.grad_pages.tensor
        if self.mixed:                                 # the fp32 values → the master (= parameter) chunk, bf16 storage
            u.master = u.param_chunk.copy_(values[lo:hi])
            u.param_buffer.copy_(values)
        else:
            u.param_chunk.copy_(u.param_buffer[lo:hi])
        stepped_dtype = torch.float32 if self.mixed else stored
        u.moments = (chunk(stepped_dtype), chunk(stepped_dtype)) if self.arena is not None else ()

    @torch.no_grad()
    def lay_out(self, u: Unit) -> None:
        """Allocate ``u``'s buffers, make the parameters and gradients views of them and record
        what this rank steps (module docstring; ZeRO-3: :meth:`_lay_out_zero3`)."""
        first, shapes = u.params[0], [p.shape for p in u.params]
        u.layout = u.layout or FlatLayout.of([p.numel() for p in u.params], u.parts)
        new = lambda n, dtype=first.dtype: torch.zeros(n, dtype=dtype, device=first.device)     # noqa: E731
        lo, hi = u.layout.chunk(u.part)
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
            for name, p, off, (a, b) in zip(u.names, u.params, u.layout.offsets, u.layout.owned(u.part)):
                if b > a:
                    u.stepped.append(SteppedTensor(name, p, stepped[off + a - lo:off + b - lo], (a, b)))
                    if u.moments:                      # the optimizer's state for it (ZeroDataParallel.adam_moments)
                        self.moments[id(u.stepped[-1].tensor)] = tuple(m[off + a - lo:off + b - lo]
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
                u.attach_grads()
        else:                                          # allocated when the unit's first backward starts
            u.release_grads()
            u.grads_live = False

