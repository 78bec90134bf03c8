"""Does a config's layout fit this machine's memory? ``gridshard train`` and ``--check`` ask
before any worker starts, print the answer and refuse (exit 2) when it does not.

Predicted peak per rank: the planner's worst rank of the config's own layout
(:func:`gridshard.planner.cost_memory.layout_memory`, i.e.
:func:`gridshard.theory.memory.predict_rank_memory` — what the trainer later logs as
``predicted_mem_bytes`` — over data rank 0 and the heaviest pipeline ranks, with the even
stage split), with the planner's margin: ``total_with_margin`` (10 % of what the step allocates
and frees again, :attr:`~gridshard.theory.memory.RankMemory.margin`) is compared, the rule
``gridshard plan`` applies, so a layout the planner accepts is one ``gridshard train`` starts. The
baseline (what a process holds before the model exists)
is the packaged hardware file's ``reserved_bytes``: ``cpu`` (Python + torch + gloo, ~350 MiB)
on the host, plus on the host what loading image data adds to each worker
(:func:`gridshard.data.images.image_data_resident_bytes`: the digits' scikit-learn import and images),
``h100`` (CUDA context, NCCL, allocator: 2 GiB) on a GPU. With
``train.offload=optimizer`` on a GPU the AdamW state lives in host memory and is left out of
the device's bytes.

Memory each rank may use:

* a GPU's memory (``torch.cuda.get_device_properties(i).total_memory``, the smallest of the
  visible devices) on CUDA — one rank per device; the packaged GPU profiles hold the same figure;
* ``HOST_USABLE_FRACTION`` (90 %) of the host's RAM (``/proc/meminfo`` MemTotal, else
  ``SC_PAGE_SIZE × SC_PHYS_PAGES``; the rest is the system's, the launcher's and the page cache's)
  shared by the local worker processes on CPU: ``local`` × per-rank must fit, so each rank gets
  1/``local`` of it (under torchrun ``local`` is ``LOCAL_WORLD_SIZE``).

When the layout does not fit, the refusal names the nearest layout that does on the same
number of processes, as ``gridshard plan`` would choose it: :func:`gridshard.planner.search.plan`
over every layout of the world size, with the device memory set to the per-rank budget
(the same margin, so its test is this one), best predicted step time first; when none fits, the
planner's own message (the smallest layout, and on GPUs the nearest device count that fits —
more local CPU processes share the same RAM and do not help).

The machine is asked through :func:`machine_budget` (tests pass their own
:class:`MemoryBudget`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

HOST_USABLE_FRACTION = 0.9
GIB = 1 << 30


def gib(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes one rank may use (``per_rank``), the memory they come from (``total``, what
    ``where`` names) and whether it is a GPU's (one per rank) or host RAM shared by ``local``."""

    per_rank: int
    total: int
    where: str
    cuda: bool = False
    local: int = 1


def host_memory_bytes() -> int:
    """The machine's RAM: ``/proc/meminfo`` MemTotal, else ``SC_PAGE_SIZE × SC_PHYS_PAGES``."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def machine_budget(local: int, cuda: Optional[bool] = None) -> MemoryBudget:
    """This machine's budget per rank for ``local`` worker processes (module docstring)."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count():
        props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                    key=lambda p: p.total_memory)
        total = int(props.total_memory)
        return MemoryBudget(total, total, f"each GPU's {gib(total)} ({props.name})", cuda=True, local=local)
    total = host_memory_bytes()
    return MemoryBudget(int(HOST_USABLE_FRACTION * total / max(1, local)), total,
                        f"{HOST_USABLE_FRACTION:.0%} of {gib(total)} host RAM shared by {local} local "
                        f"process{'es' if local > 1 else ''}", cuda=False, local=local)


def config_layout(cfg):
    """The planner's :class:`~gridshard.planner.layouts.Layout` of a validated config. A 2.5D config
    (d depth layers) is priced as what each rank runs: 2D on its layer's q² ranks with m/d rows per
    micro-batch and D·d replicas (the same A micro-batches; ZeRO shards over the depth too), as the
    trainer's ``predicted_mem_bytes`` does (docs/tp2p5d.md): the planner's 2.5D layout of the config,
    :meth:`~gridshard.planner.layouts.Layout.layer_layout`, the rule the planner prices 2.5D with."""
    from .layouts import Layout

    p, t = cfg.parallel, cfg.train
    return Layout(p.data, p.pipeline, p.tensor, str(p.tensor_mode), p.sequence_parallel, t.zero, t.recompute,
                  t.micro_batch, p.pipeline_schedule, p.virtual_stages,
                  None if p.stage_layers is None else tuple(p.stage_layers), p.context, p.context_mode,
                  p.tensor_depth, t.overlap_grad_reduce, p.expert, p.expert_dispatch).layer_layout()


def _hardware(budget: MemoryBudget):
    """The packaged hardware the baseline and margin come from, its memory set to the budget."""
    from .hardware import load_hardware

    hw = load_hardware("h100" if budget.cuda else "cpu")
    return dataclasses.replace(hw, device_memory_bytes=budget.per_rank)


def predicted_peak(cfg, budget: MemoryBudget):
    """(worst rank's RankMemory, its pipeline rank) of the config's layout (module docstring)."""
    from ..data.images import image_data_resident_bytes
    from .cost_memory import layout_memory

    hw = _hardware(budget)
    baseline = hw.reserved_bytes + (image_data_resident_bytes(cfg) if not budget.cuda else 0)
    mem, rank = layout_memory(cfg.model.resolve(), config_layout(cfg), cfg.data.seq_len, cfg.train.global_batch,
                              baseline, hw.margin_fraction, cfg.train.precision, cfg.data.document_mask)
    if budget.cuda and cfg.train.offload == "optimizer":
        mem = dataclasses.replace(mem, optimizer=0)
    return mem, rank


def _parts(mem) -> str:
    return (f"params {gib(mem.params)}, grads {gib(mem.grads)}, optimizer {gib(mem.optimizer)}, activations "
            f"{gib(mem.activations)}, buffers {gib(mem.comm_buffers + mem.transient)}, baseline {gib(mem.baseline)}")


def _changed_keys(cfg, layout) -> list:
    """``section.key=value`` of ``layout`` that differ from ``cfg``."""
    out = []
    for section, values in (("parallel", layout.parallel_section()), ("train", layout.train_section())):
        have = getattr(cfg, section)
        for k, v in values.items():
            if getattr(have, k) != v:
                shown = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v).replace(" ", "")
                out.append(f"{section}.{k}={shown}")
    return out


def nearest_fit(cfg, world: int, budget: MemoryBudget) -> str:
    """The "what instead" of a refusal: the feasible layout on ``world`` processes that changes
    the fewest keys of ``cfg`` (then the fastest), from the planner's candidates; or the
    planner's message when nothing fits (module docstring)."""
    from .search import no_layout_message, plan

    result = plan(cfg, world, hardware=_hardware(budget), raise_if_none=False)
    if result.candidates:
        best = min(result.candidates, key=lambda c: (len(_changed_keys(cfg, c.layout)), c.predicted_step_s))
        procs = f"{world} process{'es' if world > 1 else ''}"
        return (f"Fix: the nearest layout that fits on {procs} is {best.layout.label()} at "
                f"{gib(best.memory.total_with_margin)} with its margin "
                f"per rank: set {' '.join(_changed_keys(cfg, best.layout))} (`gridshard plan --gpus {world}` ranks "
                f"every layout that fits), or use a smaller model.")
    msg = no_layout_message(result)
    if budget.cuda:
        return f"{msg} Fix: run on that many GPUs (--nproc, or torchrun over several machines), or use a smaller model."
    # more local processes share the same RAM: the planner's other device counts do not apply
    return (f"{msg.split(' Nearest feasible:')[0]} Fix: a machine with more memory, more machines (torchrun; "
            f"more local processes share the same RAM), a smaller model or a shorter data.seq_len.")


def check_memory(cfg, world: int, budget: MemoryBudget) -> str:
    """One line with the predicted peak per rank and the budget; ConfigError when it does not
    fit (module docstring). A model the memory model does not describe (``ModelSection.unmodelled``):
    the line says so. Context parallelism (C > 1) is: the layout's C and mode are priced."""
    if cfg.model.unmodelled() is not None:
        return f"predicted peak memory per rank: not modelled for {cfg.model.unmodelled()}"
    mem, rank = predicted_peak(cfg, budget)
    where = f" (pipeline rank {rank})" if cfg.parallel.pipeline > 1 else ""
    line = (f"predicted peak memory per rank: {gib(mem.total_with_margin)}{where} ({_parts(mem)}, margin "
            f"{gib(mem.margin)}); usable {gib(budget.per_rank)} per rank ({budget.where})")
    if mem.total_with_margin <= budget.per_rank:
        return line
    raise ConfigError(
        f"the predicted peak memory per rank with its margin is {gib(mem.total_with_margin)} ({mem.total_with_margin} "
        f"bytes{where}: {_parts(mem)}, margin {gib(mem.margin)}: {mem.margin_fraction:.0%} of the activations, "
        f"buffers and transients), more than the {gib(budget.per_rank)} ({budget.per_rank} bytes) each rank may "
        f"use ({budget.where}): the run would run out of memory. {nearest_fit(cfg, world, budget)}")


__all__ = ["MemoryBudget", "HOST_USABLE_FRACTION", "host_memory_bytes", "machine_budget", "config_layout",
           "predicted_peak", "nearest_fit", "check_memory"]
