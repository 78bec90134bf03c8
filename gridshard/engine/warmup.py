"""The collective timeout while ``train.compile`` compiles: the first step (and evaluation) of a
process gets ``train.compile_timeout_s``, every later collective ``train.collective_timeout_s``.

Why: ``torch.compile`` compiles each decoder layer lazily, at its first forward and backward,
and again at the first forward under ``torch.no_grad`` (evaluation: grad mode is one of the
guards). A rank compiling is a rank not yet at the next collective, so its peers wait: in a
pipeline stage s receives its first activation only after stages 0 … s−1 compiled their
forward, so the last stage waits for about P − 1 compile times (and the first stage for the
others' backward compiles), which with tens of seconds per stage can pass
``collective_timeout_s`` (default 120 s) and fail a healthy job. Data and tensor peers compile
the same graphs at the same time, so they wait only for the slowest of them.

What it does: with ``train.compile``, :func:`start_warmup` (called by
:func:`gridshard.engine.job.build_job` at its end) sets the timeout of every group the job's
collectives use — the world, the mesh's data / pipeline / tensor (2D: row, col) groups, the tied
embedding pair — to max(``compile_timeout_s``, ``collective_timeout_s``);
:meth:`CompileWarmup.done` is told when the first training step (``"step"``) and, when the job has
validation data, the first evaluation (``"eval"``) have finished, and after both it gives each
group back the timeout it had — ``collective_timeout_s`` when gridshard started the process group
(:func:`gridshard.mesh.init_distributed`; the mesh's groups take the world's), a caller's own
when it started the group itself (the test harness) — torchtitan's ``init_timeout_seconds`` →
``train_timeout_seconds`` pattern. Each rank switches when its own passes finished; a faster rank's next collective then
waits with the short timeout only for peers that are past their compiles too. Without
``train.compile`` nothing changes. Checkpoint groups (their own gloo group) are not touched.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..mesh import group_timeout_s, set_collective_timeout


class CompileWarmup:
    """The raised timeout of ``groups`` until the ``pending`` passes ("step", "eval") are done;
    then each group's timeout from before (``steady_s`` where the backend does not say)."""

    def __init__(self, groups: list, steady_s: float, warmup_s: float, pending: set):
        self.pending = set(pending)
        self.before = [(g, group_timeout_s(g) or steady_s) for g in groups]
        set_collective_timeout(groups, max(warmup_s, steady_s))

    def done(self, what: str) -> None:
        """The first pass of kind ``what`` finished on this rank; the last one restores the timeouts."""
        if what in self.pending:
            self.pending.remove(what)
            if not self.pending:
                for group, seconds in self.before:
                    set_collective_timeout([group], seconds)


def start_warmup(job) -> Optional[CompileWarmup]:
    """With ``train.compile`` (and a process group of more than one rank), the job's warm-up
    (module docstring); else None."""
    t = job.cfg.train
    if not t.compile or dist.get_world_size() == 1:
        return None
    groups = [dist.group.WORLD] + job.mesh.groups() + (job.tied.groups() if job.tied is not None else [])
    pending = {"step"} | ({"eval"} if job.val_plan is not None else set())
    return CompileWarmup(groups, t.collective_timeout_s, t.compile_timeout_s, pending)
