"""Data parallelism over ``mesh.data`` at every ZeRO stage: one class, :class:`ZeroDataParallel`,
the stage a number it reads in a few named places (:mod:`gridshard.zero.reducer` has the table).

The reducer is three parts composed here, each in the file that describes it:

* :mod:`.units` — units (ZeRO-0 buckets, decoder layers, the root) and their flat buffers,
  what each rank steps, the bytes per stage (:class:`~.units.UnitLayout`);
* :mod:`.gather` — ZeRO-3's gather, free and prefetch of a unit's parameters around each use
  (:class:`~.gather.ParameterGather`);
* :mod:`.reduction` — gradient accumulation over micro-batches and the all-reduce /
  reduce-scatter launched as units complete, the step's communication
  (:class:`~.reduction.GradientReduction`);

with the flags they read decided once (:class:`~.settings.ZeroSettings`) and ZeRO-3's memory
outside glibc's heap on CPU in :mod:`.pages`. :class:`ZeroDataParallel` builds them in order and
is what the trainer, the optimizer, the norm and the checkpoint see.

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

import warnings
from typing import Optional

import torch
from torch import nn

from .gather import ParameterGather
from .pages import StagingPool, heap_trimmer, pages_act
from .stepped import whole_parameters
from .reduction import GradientReduction
from .settings import MAX_IN_FLIGHT, ReadsSettings, ZeroSettings
from .units import Unit, UnitLayout

__all__ = ["MAX_IN_FLIGHT", "Unit", "ZeroDataParallel", "offload_note", "warn_offload_on_cpu"]


class ZeroDataParallel(ReadsSettings):
    """ZeRO stage ``stage`` (0–3) of ``model`` (laid out by :func:`gridshard.parallelize`) over
    ``data_axis`` (a :class:`gridshard.mesh.Axis`; module docstring); ``expert_axes``: (``mesh.expert``,
    ``mesh.expert_data``) when an MoE model's experts are split over E > 1 expert ranks, whose
    parameters are then reduced over ``expert_data`` (:mod:`.units`). ``bucket_bytes``: ZeRO-0's
    bucket size. ``overlap``: issue each unit's reduction in the backward as soon as its
    gradients are complete; ``defer_root``: not the root unit's
    (:meth:`~.reduction.GradientReduction._shards_now`). ``host_pages``
    (``train.zero3_host_memory`` resolved by :func:`~.pages.host_pages_in_effect`; ZeRO-3 on a
    Linux CPU, else no effect): ZeRO-3's own
    memory outside glibc's heap (:mod:`gridshard.zero.pages`). ``self.stage``, ``self.overlap``,
    ... are :attr:`settings`' fields."""

    def __init__(self, model: nn.Module, data_axis, stage: int, bucket_bytes: int = 25 << 20, overlap: bool = True,
                 param_dtype: torch.dtype = torch.float32, grad_reduce_dtype: torch.dtype = torch.float32,
                 defer_root: bool = False, host_pages: bool = False, expert_axes: Optional[tuple] = None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroDataParallel: stage {stage} is not 0, 1, 2 or 3. Fix: set train.zero to one of them")
        self.model, self.axis = model, data_axis
        self.expert_axis, expert_data = expert_axes or (None, None)
        self.settings = ZeroSettings.of(stage, data_axis, overlap, param_dtype, grad_reduce_dtype, defer_root)
        # ZeRO-3 host pages: chunks and AdamW moments in one mapping, staging slots (gridshard.zero.pages)
        device = next(model.parameters()).device
        self.host_pages = host_pages and pages_act(stage, device)
        layout = UnitLayout(self.settings, self.host_pages, data_axis, expert_data)
        self.units = layout.units(model, bucket_bytes)
        self.arena = layout.plan_arena(self.units, device) if stage == 3 else None
        # host pages at D > 1: 2 send and MAX_IN_FLIGHT + 1 receive slots of the largest unit in fp32
        pooled = self.arena is not None and data_axis.size > 1
        self.staging = StagingPool(4 * max(u.layout.padded for u in self.units), device, gathers=2,
                                   reductions=MAX_IN_FLIGHT + 1) if pooled else None
        self._moments = layout.moments                 # id(stepped tensor) → (exp_avg, exp_avg_sq) views
        trim = heap_trimmer(device) if self.host_pages else None
        self.gathering = ParameterGather(self.units, self.overlap, stage == 3, self.staging, trim)
        self.reduction = GradientReduction(self.settings, data_axis, self.units, self.staging, self.gathering)
        # the step, as the trainer drives it (:class:`~.reduction.GradientReduction`: arm before the last
        # backward, sync after it, after_step after the optimizer, zero_grad before the next), and ZeRO-3's
        # parameters (:class:`~.gather.ParameterGather`: ``with gathered():`` every parameter whole, free_all)
        self.arm, self.sync = self.reduction.arm, self.reduction.sync
        self.after_step, self.zero_grad = self.reduction.after_step, self.reduction.zero_grad
        self.gathered, self.free_all = self.gathering.gathered, self.gathering.free_all
        for u in self.units:
            layout.lay_out(u)
            for p in u.params:
                if self.overlap or stage == 3:
                    p.register_post_accumulate_grad_hook(self.reduction.on_grad(u))
                if stage >= 2:
                    p.register_hook(self.reduction.before_accumulate(u))
            self.gathering.free(u)                     # ZeRO-3: the chunk holds the values now
        if stage == 3:
            self.gathering.install_hooks()
            self.gathering.trim_heap()                 # host pages: the original parameters, freed above, leave
        model.grad_reducer = self                      # gathered_state_dict finds the shards through it

    # ---- what the optimizer, the norm and the checkpoint see -------------------------------
    @property
    def norm_axis(self):
        """ZeRO ≥ 1: the norm of the stepped elements is summed over data ranks too (each element
        once); ZeRO-0: None, every rank holds whole gradients."""
        return self.axis if self.stage else None

    @property
    def expert_norm_axis(self):
        """ZeRO-0 with experts split over E > 1 expert ranks: ``mesh.expert``, over which their whole
        blocks differ (:func:`gridshard.engine.clip.global_grad_norm`); otherwise None."""
        return self.expert_axis if self.stage == 0 else None

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
        return out + ([u.param_chunk for u in self.units if u.param_chunk is not u.master] if self.stage == 3 else [])

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
