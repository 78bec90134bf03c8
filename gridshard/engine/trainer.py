"""The training loop, callable inside an already-initialised process group: a job composed by
:func:`gridshard.engine.job.build_job`, stepped by :func:`gridshard.engine.step.train_step`.

``train(config, run_dir=None) -> [loss per step]`` runs on every rank of the job
(torchrun workers, the CLI's elastic workers, or the test harness's gloo groups).
One optimizer step is :func:`gridshard.engine.step.train_step` (its module docstring holds
the step's math: the micro-batches, the normalisation by the global batch's valid targets N).

The step's loss: rank d's share (1/N) Σ_a L_da, summed over data ranks only at log steps
(one small all-reduce of the interval's shares, not recorded in the ledger).

Validation (``data.val_fraction`` / ``data.val_path``, a prepared folder's split): every
``train.eval_interval`` steps and at the last step, :meth:`Trainer.evaluate` computes

    val_loss = (Σ_j Σ_{d,a} L_jda) / (Σ_j N_j)      over evaluation batches j < train.eval_batches

with no gradient: batch j is G windows of the validation tokens (:mod:`gridshard.data.batches`,
``stream=1``, the same windows at every evaluation and every layout), split over data ranks
and micro-batches exactly like a training batch, L_jda the summed loss of a micro-batch and
N_j the batch's valid targets. One all-reduce over data ranks (not in the ledger) sums the
L's; so the value is the mean over the same targets at any layout, up to summation order.

Checkpoints (:mod:`gridshard.checkpoint`): with a run directory, the state after step k is
saved every ``train.save_interval`` steps (asynchronously; the training thread only copies
its blocks) and at the end of the run; ``train.resume`` continues from one at any layout.
A resumed run starts at the checkpoint's step k: step k+1 reads the same global batch and
learning rate as in the uninterrupted run, so at the same layout the continuation is the
same computation, bit for bit.

Stopping on request (:mod:`gridshard.engine.control`, installed by the CLI's workers): after a
SIGINT the ranks agree at a step end (one-element MAX all-reduce over the world, every step on
CPU, at log steps on GPUs; not in the ledger) to stop after step k; step k is logged, the state
after it is checkpointed (blocking) when there is a run directory, and every rank raises
:class:`~gridshard.engine.control.TrainingStopped`.

Non-finite values (``train.on_nonfinite``). Every step reads the global gradient norm ‖g‖ (the
same value on every rank after its all-reduces; one host synchronisation per step on GPUs)
before the optimizer step. A NaN/inf ‖g‖ would poison the weights, so with ``stop`` (the
default) every rank waits for the save in flight (an earlier, finite step's, so ``latest``
names the last finite checkpoint) and raises :class:`~gridshard.errors.NonFiniteError`, one
line naming the step, the value and that checkpoint (the CLI: exit 3); the step's update is
never taken. With ``skip`` the step's gradients are dropped (no optimizer step: AdamW's
moments and step count stay as they were, so the weights equal those before the step), a
warning names the step, ``skipped_steps`` in the metrics counts them; the batch is not retried
and the learning-rate schedule, a function of the step number, moves on. Under fp16 a
non-finite ‖g‖ is the loss scaler's overflow, skipped as always; it is divergence only when the
step's loss is not finite on some data rank (agreed by a one-element all-reduce on such steps).
The loss, summed over data ranks at log steps only, is checked there too (a NaN/inf loss with a
finite ‖g‖ is rare): ``stop`` stops, ``skip`` warns. Independently, the checkpointer never
publishes a checkpoint whose weights or moments hold NaN/inf (:mod:`gridshard.checkpoint.checkpointer`).
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.faults import hit
from ..comm import collectives as C
from ..errors import NonFiniteError
from ..mesh import world_axis
from ..theory.training import mfu, model_flops_per_token
from ..torch_private import default_store
from . import control
from .gc_control import StepCollector
from .hang import explain_timeout, is_collective_timeout
from .job import Job, build_job
from .metrics import RunFiles, device_peak_flops, format_postfix, interval_memory_peaks
from .placement import gather_placement, write_launch_record
from .profiling import StepProfiler
from .rank_timing import straggler_verdict
from .step import accuracy_metrics, evaluate, global_losses, train_step


class Trainer:
    """The training loop over :func:`gridshard.engine.step.train_step` of a job composed by
    :func:`gridshard.build_job` (``self.job``): learning-rate steps, logging and metrics,
    checkpoints, evaluation, non-finite values and stop requests. The job's parts are read as
    the trainer's attributes (``trainer.model``, ``.mesh``, ``.context``, ``.reducer``,
    ``.optimizer``, ``.pipeline``, ``.checkpointer``, ``.cfg``, ``.plan`` …: every field of
    :class:`~gridshard.engine.job.Job`)."""

    def __init__(self, config, run_dir: Optional[str] = None, progress: bool = True, overrides=()):
        self.job: Job = build_job(config, run_dir, overrides=overrides)
        t, mc, seq = self.cfg.train, self.model_cfg, self.cfg.data.seq_len
        self.step_valid_tokens = None                  # N of the last step (valid targets, global batch)
        self.skipped_steps = 0                         # updates dropped by train.on_nonfinite=skip
        self.skipped_recent: set = set()               # their step numbers since the last log step
        self.flops_token = model_flops_per_token(self.cfg.model.kind, mc, seq)
        self.peak_flops = device_peak_flops(self.device, t.precision, t.tf32, t.peak_flops)
        self.predicted_mem = self._predict_memory(getattr(self.plan, "tokens", None),
                                                  getattr(self.val_plan, "tokens", None))
        self.profiler = StepProfiler(t, self.rank, self.run_dir, self.device, self.ranges)   # train.profile_*
        self.collector = StepCollector(t.gc_interval)  # Python's cyclic collector, in step (train.gc_interval)
        self.data_s = 0.0                              # seconds producing batches so far (engine.rank_timing)
        self.straggler_named: Optional[int] = None     # the straggler last warned about
        self.files = RunFiles(self.run_dir, active=self.rank == 0,
                              keep_until_step=self.start_step if self.resume_from is not None else None,
                              log_to=t.log_to)
        self.files.write_config(self.cfg.resolved())
        if self.run_dir is not None:                   # where each rank runs, for `gridshard diagnose` (engine.placement)
            record = gather_placement(self.rank, self.mesh, self.ledger)
            if self.rank == 0:
                write_launch_record(self.run_dir, record)
        self.progress = progress
        self.history: list = []                        # metrics records (every rank)

    def __getattr__(self, name: str):
        """The job's parts (class docstring); only names the trainer itself does not set."""
        job = self.__dict__.get("job")
        if job is not None and name in Job.__dataclass_fields__:
            return getattr(job, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _predict_memory(self, tokens, val_tokens):
        """This rank's predicted peak bytes (:func:`gridshard.theory.memory.predict_rank_memory`),
        or None for a model the memory model does not describe (``ModelSection.unmodelled``). At C > 1
        ZeRO shards over data × context: the model state is that of D·C data ranks. At 2.5D (d depth
        layers) a rank is priced as 2D on its layer's q² ranks with m/d rows per micro-batch and the
        depth among the D·C·d ranks ZeRO shards over (``JobLayout.layer_mode``, docs/tp2p5d.md). On CPU the
        baseline is the resident set before the model was built plus what loading the data added to it
        (``Job.data_bytes``: the data's imports, e.g. scikit-learn for the digits, and its resident arrays).
        Interleaved 1F1B and zero bubble (V stages per rank): as the planner adapts it
        (:func:`gridshard.theory.memory.predict.with_virtual_stages`)."""
        if self.cfg.model.unmodelled() is not None:
            return None
        from ..parallel.decoder_layers import decoder_layers
        from ..parallel.rank_blocks import rank_parameter_blocks
        from ..theory.memory import predict_rank_memory
        from ..theory.memory.predict import with_virtual_stages
        from ..theory.pipeline import boundary_bytes

        p, t = self.cfg.parallel, self.cfg.train
        resident = [x for x in (tokens, val_tokens) if x is not None and not isinstance(x, np.memmap)]
        ids = [int(name.rsplit(".", 1)[1]) for name, _ in decoder_layers(self.model)] if p.pipeline > 1 else None
        stage = self.mesh.pipeline.rank                # the rank's blocks: its stages, first / last ends
        mode, T, depth = self.layout.layer_mode, self.layout.layer_tensor, self.layout.depth
        blocks = rank_parameter_blocks(self.model_cfg, mode, T, ids, stage == 0, stage == p.pipeline - 1, p.expert)
        mem = predict_rank_memory(
            self.model_cfg, mode=mode, T=T, sequence_parallel=self.layout.sequence_parallel,
            data=p.data * p.context * depth, data_rank=self.mesh.data_context.rank, zero=t.zero, recompute=t.recompute,
            micro_batch=t.micro_batch // depth,
            seq_len=self.cfg.data.seq_len, n_microbatches=self.layout.micro_batches,
            pipeline=p.pipeline, pipeline_rank=self.mesh.pipeline.rank, schedule=p.pipeline_schedule,
            layer_ids=ids, baseline_bytes=self.mem_baseline, precision=t.precision, blocks=blocks,
            grad_reduce_dtype=t.grad_reduce_dtype, context=p.context, context_mode=p.context_mode,
            overlap_grad_reduce=t.overlap_grad_reduce, expert=p.expert, documents=self.cfg.data.document_mask,
            extra_bytes=max(self.data_bytes, sum(int(getattr(x, "nbytes", 0)) for x in resident))
            if self.device.type == "cpu" else 0)
        return with_virtual_stages(mem, schedule=p.pipeline_schedule, rank=stage, P=p.pipeline, V=p.virtual_stages,
                                   A=self.layout.micro_batches, per_boundary=boundary_bytes(
                                       mode, self.layout.sequence_parallel, T, t.micro_batch // depth,
                                       self.cfg.data.seq_len // p.context, self.model_cfg.hidden, t.precision))

    # ---- checkpoints (resume and model.init_from are the composer's: gridshard.engine.job) ----
    def save_checkpoint(self, step: int, blocking: bool = False) -> None:
        """Checkpoint the state after ``step`` optimizer steps (asynchronous unless ``blocking``)."""
        t, p = self.cfg.train, self.cfg.parallel
        scaler = self.precision.scaler
        meta = {"tokens": step * t.global_batch * self.cfg.data.seq_len, "samples": step * t.global_batch,
                "loss_scaler": scaler.state_dict() if scaler is not None else None,
                "layout": {"data": p.data, "pipeline": p.pipeline, "tensor": p.tensor, "tensor_mode": p.tensor_mode,
                           "tensor_depth": p.tensor_depth, "sequence_parallel": p.sequence_parallel,
                           "context": p.context, "context_mode": p.context_mode},
                "config": self.cfg.resolved(), "saved_unix_time": time.time()}
        if hasattr(self.plan, "position"):             # record sources: every row's stream position
            meta["data_position"] = self.plan.position()
        self.checkpointer.save(step, self.model, self.optimizer, meta, blocking=blocking, reducer=self.reducer)

    # ---- one optimizer step -----------------------------------------------------------
    def step(self, k: int):
        """Run optimizer step ``k`` (:func:`gridshard.engine.step.train_step` with this trainer's
        non-finite policy); returns (this data rank's share of the step's loss — the sum over
        data ranks is the global loss; NaN when the step has no valid target —, global grad
        norm, lr) as tensors/floats without synchronising the host. The step's global
        valid-target count N is left in ``self.step_valid_tokens``."""
        start = time.perf_counter()
        batch = self.job.batch(k)
        self.data_s += time.perf_counter() - start          # data loading, per rank (engine.rank_timing)
        result = train_step(self.job, batch, skip_update=self._skip_nonfinite)
        self.step_valid_tokens = result.valid_targets
        return result.loss_share, result.grad_norm, result.lr

    # ---- non-finite values (train.on_nonfinite) ------------------------------------------
    def _skip_nonfinite(self, k: int, norm: torch.Tensor, sums: list) -> bool:
        """Whether step ``k``'s update is dropped because its gradient norm is not finite; with
        ``train.on_nonfinite=stop`` raise :meth:`_diverged` instead (module docstring).

        The global norm is the same on every rank (after its all-reduces), so every rank takes
        the same branch at the same step. Reading it costs one host synchronisation per step on
        GPUs (the CPU waits for the step's kernels before queueing the next step's), the price
        of stopping before a NaN update instead of a log interval later. Under fp16 a non-finite
        norm is first of all the loss scaler's overflow, which it skips (and halves the scale) as
        always; it is divergence only when the forward's loss itself is not finite on some data
        rank (no loss scale helps there) — one more one-element all-reduce, on such steps only."""
        value = float(norm)                            # the host sync (docstring)
        if math.isfinite(value):
            return False
        what = f"the global gradient norm is {value}"
        if self.precision.scaler is not None:
            if not self._loss_nonfinite(sums):
                return False                           # an fp16 overflow: the scaler skips the step
            what = f"the loss is not finite (the gradient norm is {value}; fp16)"
        if self.cfg.train.on_nonfinite == "stop":
            raise self._diverged(k + 1, what, "; stopped before the step's update (train.on_nonfinite=stop)")
        self.skipped_steps += 1
        self.skipped_recent.add(k + 1)
        if self.rank == 0:
            warnings.warn(f"step {k + 1}: {what}: its update was skipped (train.on_nonfinite=skip; "
                          f"{self.skipped_steps} skipped so far)", RuntimeWarning, stacklevel=3)
        return self.precision.scaler is None           # fp16: the scaler's own skip drops it

    def _loss_nonfinite(self, sums: list) -> bool:
        """Whether some data rank's micro-batch loss of this step is NaN/inf (over data and pipeline
        ranks; every rank gets the same answer)."""
        bad = bool(sums) and not bool(torch.isfinite(torch.stack(sums)).all())
        return self._on_any_rank(bad, self.mesh.data_context, self.mesh.pipeline)

    def _on_any_rank(self, flag: bool, *axes) -> bool:
        """Whether ``flag`` holds on some rank of ``axes``: one MAX all-reduce of a one-element flag
        per axis, not in the ledger."""
        x = torch.tensor([1.0 if flag else 0.0], device=self.device)
        with self.ledger.paused():
            for axis in axes:
                x = C.all_reduce(x, axis, op="max", inplace=True)
        return bool(x[0] > 0)

    def _last_checkpoint(self) -> str:
        """The last complete checkpoint, for messages (after the save in flight is done)."""
        if self.checkpointer is None or self.checkpointer.root is None:
            return self.resume_from or "none (no run directory)"
        return self.checkpointer.latest() or self.resume_from or "none was written"

    def _diverged(self, step: int, what: str, how: str = "") -> NonFiniteError:
        """The error every rank raises when ``step`` diverged (train.on_nonfinite=stop): first
        the save in flight — of an earlier, finite step — is waited for, so ``latest`` names the
        last finite checkpoint, and the checkpointer is closed."""
        note = ""
        if self.checkpointer is not None:
            try:
                self.checkpointer.close()
            except Exception as e:                     # noqa: BLE001 (named; the divergence is the news)
                note = f" (and the save in flight failed: {' '.join(str(e).split())})"
        t = self.cfg.train
        return NonFiniteError(
            f"step {step}: {what}: the run diverged (train.lr={t.lr:g}, train.grad_clip={t.grad_clip:g}){how}{note}; "
            f"last finite checkpoint: {self._last_checkpoint()}. Fix: lower train.lr (or train.grad_clip) and "
            f"continue from that checkpoint (--resume latest --allow-changed-schedule), or start again; "
            f"train.on_nonfinite=skip skips such steps instead of stopping.")

    def evaluate(self) -> Optional[float]:
        """The validation loss (module docstring; :func:`gridshard.engine.step.evaluate`), the
        same value on every rank; None without validation data or when no target is valid."""
        return evaluate(self.job)

    def _meter_marks(self) -> tuple:
        m = self.pipeline.meter if self.pipeline is not None else None
        return (m.busy_s, m.schedule_s) if m is not None else (0.0, 0.0)

    def _gather_rank_stats(self, comm_s: float, wall_s: float, busy: tuple = (0.0, 0.0), data_s: float = 0.0,
                           n_steps: int = 1, warm_up: bool = False) -> tuple:
        """(mean communication share, peak memory per rank, pipeline bubble share per rank,
        predicted peak memory per rank, peak reserved memory per rank or None on CPU, the interval's
        :class:`~gridshard.engine.rank_timing.StragglerVerdict` or None without collective timing);
        ``busy``: (time in stage forward/backward, wall time in the schedule) of the interval;
        ``comm_s`` / ``data_s``: this rank's seconds in collectives / data loading over its ``n_steps``;
        ``warm_up``: the interval is the process's first (no straggler named from it)."""
        idle = 1.0 - busy[0] / max(busy[1], 1e-12) if self.pipeline is not None else 0.0
        predicted = float(self.predicted_mem.total) if self.predicted_mem is not None else -1.0
        allocated, reserved = interval_memory_peaks(self.device)
        stats = torch.tensor([[comm_s / max(wall_s, 1e-12), float(allocated), idle, predicted,
                               -1.0 if reserved is None else float(reserved), comm_s, data_s]],
                             dtype=torch.float64, device=self.device)
        with self.ledger.paused():
            allr = C.all_gather(stats, world_axis(self.ledger), dim=0).cpu()
        bubble = [float(x) for x in allr[:, 2]] if self.pipeline is not None else None
        predicted = [int(x) for x in allr[:, 3]] if self.predicted_mem is not None else None
        reserved = [int(x) for x in allr[:, 4]] if reserved is not None else None
        verdict = straggler_verdict(wall_s / n_steps, [float(x) / n_steps for x in allr[:, 5]],
                                    [float(x) / n_steps for x in allr[:, 6]], n_steps, warm_up) \
            if self.ledger.timing else None
        return float(allr[:, 0].mean()), [int(x) for x in allr[:, 1]], bubble, predicted, reserved, verdict

    # ---- stopping on request (gridshard.engine.control) ---------------------------------
    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGINT) by now: one all-reduce (MAX) of a
        one-element flag over the world, not in the ledger, so all ranks stop after the same step."""
        with self.ranges("gridshard.stop_check"):
            return self._on_any_rank(control.stop_requested(), world_axis(self.ledger))

    def _stopped(self, step: int, saving: bool, losses: list) -> "control.TrainingStopped":
        """Checkpoint the ``step`` completed steps (blocking; the save in flight, if it is this
        step's, is awaited instead), close the checkpointer; the exception to raise."""
        folder = None
        if saving:
            if self.checkpointer.last_requested != step:
                self.save_checkpoint(step, blocking=True)
            from ..checkpoint.files import step_dir_name

            folder = os.path.join(self.checkpointer.root, step_dir_name(step))
        if self.checkpointer is not None:
            self.checkpointer.close()
        return control.TrainingStopped(step, folder, losses)

    # ---- the loop --------------------------------------------------------------------
    def run(self) -> list:
        """Train ``train.steps`` steps; returns the global loss of every step (None for a step
        without valid targets)."""
        from tqdm import tqdm

        t = self.cfg.train
        prev_timing = self.ledger.timing
        self.ledger.timing = t.time_comm if t.time_comm is not None else self.device.type != "cuda"
        bar = tqdm(total=t.steps, disable=not (self.progress and self.rank == 0), file=sys.stderr,
                   dynamic_ncols=True, desc="train")
        all_losses: list = []
        self._run_start = time.perf_counter()
        window = self._window(self._run_start, self.start_step)
        bar.update(self.start_step)
        saving = self.checkpointer is not None and self.checkpointer.root is not None
        stoppable = control.stop_installed()           # the same on every rank (install_stop_handler)
        try:
            self.collector.start()
            for k in range(self.start_step, t.steps):
                self.ranges.step, self.ranges.phase, self.ranges.micro_batch = k + 1, None, None   # engine.hang
                self.profiler.before_step(k)
                loss, norm, lr = self.step(k)
                window.pending.append((loss, self.step_valid_tokens))
                bar.update(1)
                hit(self.faults, "step", self.rank, k + 1)
                if saving and t.save_interval and (k + 1) % t.save_interval == 0:
                    with self.ranges("gridshard.checkpoint"):
                        self.save_checkpoint(k + 1)
                if self.collector.due(k + 1):
                    with self.ranges("gridshard.gc"):
                        self.collector.collect()
                self.profiler.after_step(k)
                is_eval = self.val_plan is not None and (
                    (t.eval_interval and (k + 1) % t.eval_interval == 0) or k + 1 == t.steps)
                log_step = not ((k + 1) % t.log_interval and k + 1 != t.steps and not is_eval)
                # a stop request is agreed on at every step end on CPU (one tiny gloo all-reduce), at
                # log steps on GPUs (reading the flag synchronises the host with the device)
                stop = stoppable and (log_step or self.device.type == "cpu") and self._stop_agreed() \
                    and k + 1 != t.steps
                if log_step or stop:
                    with self.ranges("gridshard.log"):
                        window = self._log(k, window, norm, lr, is_eval, all_losses, bar)
                if stop:
                    raise self._stopped(k + 1, saving, all_losses)
            if saving and t.steps > self.start_step and self.checkpointer.last_requested != t.steps:
                self.save_checkpoint(t.steps, blocking=True)      # the end of the run is always saved
            if self.checkpointer is not None:
                self.checkpointer.close()
        except RuntimeError as e:
            if is_collective_timeout(e):                       # name the call and who missed it (engine.hang)
                raise explain_timeout(e, self.ledger, self.ranges, self.rank, t.collective_timeout_s,
                                      default_store()) from e
            if isinstance(e, torch.cuda.OutOfMemoryError):
                self.profiler.out_of_memory()                  # train.profile_memory: the history up to here
            raise
        finally:
            self.collector.stop()
            self.profiler.finish()
            bar.close()
            self.files.close()
            self.ledger.timing = prev_timing
        return all_losses

    def _window(self, now: float, steps: int) -> "_LogWindow":
        """A log interval starting now, after ``steps`` steps."""
        return _LogWindow(now, steps, self.ledger.seconds(), self._meter_marks(), self.data_s,
                          self.ledger.by_axis(), self.ledger.by_axis("seconds"))

    def _log(self, k: int, window: "_LogWindow", norm, lr: float, is_eval: bool, all_losses: list, bar):
        """Log step ``k``: the interval's global losses (appended to ``all_losses``), rank
        statistics, validation, the metrics record; then act on a non-finite loss. Returns the
        next interval."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        wall = now - window.time
        marks = self._meter_marks()
        busy = (marks[0] - window.busy[0], marks[1] - window.busy[1])
        stats = self._gather_rank_stats(self.ledger.seconds() - window.comm_s, wall, busy, self.data_s - window.data_s,
                                        k + 1 - window.steps, warm_up=window.steps == self.start_step)
        losses = global_losses(self.job, window.pending)
        all_losses += losses
        # the loss is known globally only here (its sum over data ranks): a non-finite one
        # with a finite gradient norm (every step's check) is rare, and is acted on now
        nonfinite = [(window.steps + 1 + i, x) for i, x in enumerate(losses)
                     if x is not None and not math.isfinite(x) and window.steps + 1 + i not in self.skipped_recent]
        self.skipped_recent.clear()
        rec = self._record(k, losses[-1], norm, lr, wall, k + 1 - window.steps, now, stats)
        if self.job.moe is not None:
            rec.update(self.job.moe.last)              # moe_aux_loss, moe_load_max, moe_dropped, moe_load
        if is_eval:
            rec["val_loss"] = self.evaluate()
            rec.update(accuracy_metrics(self.job))     # a classifier's accuracy, val_accuracy (else none)
        self.history.append(rec)
        self.files.append(rec)
        self._report_ranks(k, stats[-1], window, k + 1 - window.steps)
        bar.set_postfix(format_postfix(rec), refresh=False)
        window = self._window(time.perf_counter(), k + 1)
        if nonfinite and self.cfg.train.on_nonfinite == "stop":
            raise self._diverged(nonfinite[0][0], f"the loss is {nonfinite[0][1]} (found at the log step "
                                                  f"{k + 1}; its gradient norm was finite)")
        if nonfinite and self.rank == 0:
            warnings.warn(f"step {nonfinite[0][0]}: the loss is {nonfinite[0][1]} with a finite gradient "
                          f"norm: its update was taken (train.on_nonfinite=skip acts on non-finite gradient "
                          f"norms)", RuntimeWarning, stacklevel=3)
        return window

    def _report_ranks(self, k: int, verdict, window: "_LogWindow", n_steps: int) -> None:
        """Rank 0: the interval's per-rank table and its own collective bytes and seconds per step by axis into
        ``RUN_DIR/ranks.jsonl``, and one warning when a straggler is named that was not the last one
        named (:mod:`gridshard.engine.rank_timing`)."""
        if verdict is None or self.rank != 0:
            return
        per_axis = {a: (b - window.axis_bytes.get(a, 0)) / n_steps for a, b in sorted(self.ledger.by_axis().items())}
        seconds = {a: (s - window.axis_seconds.get(a, 0.0)) / n_steps
                   for a, s in sorted(self.ledger.by_axis("seconds").items())}
        self.files.append_ranks({"step": k + 1, "step_time_s": verdict.step_s, "rank_wait_max": verdict.rank_wait_max,
                                 "straggler_rank": verdict.straggler_rank,
                                 "ranks": [t.row() for t in verdict.ranks],
                                 "rank0_comm_bytes_per_step": {a: b for a, b in per_axis.items() if b},
                                 "rank0_comm_s_per_step": {a: seconds[a] for a, b in per_axis.items() if b}})
        if verdict.straggler_rank is not None and verdict.straggler_rank != self.straggler_named:
            warnings.warn(verdict.warning(k + 1), RuntimeWarning, stacklevel=3)
        self.straggler_named = verdict.straggler_rank

    def _record(self, k: int, loss, norm, lr: float, wall: float, n_steps: int, now: float, stats: tuple) -> dict:
        """The metrics record of log step ``k`` (docs/metrics.md): ``stats`` from :meth:`_gather_rank_stats`
        over the interval's ``n_steps`` steps and ``wall`` seconds."""
        comm_share, mems, bubble, predicted, reserved, verdict = stats
        tokens_per_step = self.cfg.train.global_batch * self.cfg.data.seq_len
        tps = n_steps * tokens_per_step / wall
        return {"step": k + 1, "loss": loss, "valid_tokens": self.step_valid_tokens,
                "lr": lr, "grad_norm": float(norm),
                "tokens_per_s": tps, "mfu": mfu(self.flops_token, tps, self.peak_flops, dist.get_world_size()),
                "comm_share": comm_share if self.ledger.timing else None, "peak_mem_bytes": max(mems),
                "peak_mem_bytes_per_rank": mems, "peak_mem_reserved_bytes": max(reserved) if reserved else None,
                "predicted_mem_bytes": max(predicted) if predicted else None,
                "predicted_mem_bytes_per_rank": predicted, "step_time_s": wall / n_steps,
                "tokens": (k + 1) * tokens_per_step, "elapsed_s": now - self._run_start,
                "loss_scale": self.precision.loss_scale(), "skipped_steps": self.skipped_steps,
                "bubble_share": max(bubble) if bubble else None, "bubble_share_per_rank": bubble,
                "rank_wait_max": verdict.rank_wait_max if verdict else None,
                "straggler_rank": verdict.straggler_rank if verdict else None}


@dataclass
class _LogWindow:
    """The current log interval: where it started (time, completed steps, communication
    seconds, pipeline meter marks, data-loading seconds) and its steps' (loss share, N) pairs."""

    time: float
    steps: int
    comm_s: float
    busy: tuple
    data_s: float = 0.0
    axis_bytes: dict = field(default_factory=dict)
    axis_seconds: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)


def train(config=None, run_dir: Optional[str] = None, overrides=(), progress: bool = False) -> list:
    """Validate ``config`` against this process group, train, return the per-step global losses
    (the same list on every rank). ``config``: YAML path, dict, TrainConfig, a launcher's
    :class:`~gridshard.engine.job.ResolvedConfig` (used as it is) or None (default)."""
    return Trainer(config, run_dir=run_dir, progress=progress, overrides=overrides).run()
