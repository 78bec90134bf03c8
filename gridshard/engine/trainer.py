"""The training loop, callable inside an already-initialised process group.

``train(config, run_dir=None) -> [loss per step]`` runs on every rank of the job
(torchrun workers, the CLI's elastic workers, or the test harness's gloo groups).
One optimizer step k, on data rank d of D with A = G/(m·D) micro-batches::

    lr ← schedule(k)
    N  ← valid targets of step k's whole global batch       (BatchPlan.step_batches: every
                                                              rank counts it, no communication)
    for each of my A micro-batches a (tokens, targets) [m, s]:  (2D: context.shard_tokens → [m/q, s])
        L_da = context.model_loss(..., reduction="sum")      Σ ℓ_i over the micro-batch's valid
                                                              targets (the tensor group's, same on
                                                              every tensor rank; 0 if none is valid)
        backward(L_da · D/N)                                  (× loss scale in fp16)
    grads ← mean over data ranks by the reducer of train.zero (gridshard.zero.reducer; issued
            during the last micro-batch's backward as each bucket/unit completes): ZeRO-0 an
            in-place all-reduce per bucket of the persistent gradient buffer (.grad are views of
            it); ZeRO ≥ 1 a reduce-scatter per layer unit, each data rank keeping its rows' mean
    ‖g‖  ← global norm, every parameter once (one all-reduce over tensor; ZeRO: over data too)
    clip to train.grad_clip; AdamW step (ZeRO: on this rank's rows, then ZeRO-1/2 all-gather them)

Normalisation. The step's loss is the mean over the valid targets (``data.ignore_token``
masks the others) of the whole global batch, L = (1/N) Σ_{d,a} L_da, and its gradient
g = (1/N) Σ_{d,a} ∇L_da. Rank d backpropagates (D/N) Σ_a L_da, so its gradient is
g_d = (D/N) Σ_a ∇L_da, and the data-parallel mean gives (1/D) Σ_d g_d = g exactly. N is
the same integer on every rank, so nothing else is communicated; micro-batches with more
valid targets weigh more, as they must. The result depends on the global batch only, not
on the micro-batch size or the layout, masked or not (up to floating-point summation
order). Without ``ignore_token`` N = G·s and every micro-batch holds m·s valid targets,
so this is the old "backward of the micro-batch mean / A, then mean over data ranks".

A step with N = 0 (every target of the global batch ignored; every rank knows it) runs
like any other with weight D/N replaced by 0: every loss sum is 0 with an exactly zero
gradient, so the gradients are zero (the same path keeps the fp16 scaler and the
overlapped reduction as usual), the optimizer still steps (AdamW's momentum and weight
decay act, as in a plain loop whose ``F.cross_entropy`` returns zero gradients), its
loss is reported as ``None`` (null in ``metrics.jsonl``) and rank 0 warns.
A micro-batch or 2D block with no valid target gets exactly zero gradient from the loss
(:mod:`gridshard.parallel.context`), never NaN.

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
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer, FaultPlan
from ..checkpoint.faults import hit
from ..checkpoint.resume import check_compatible, describe, resume_folder
from ..comm import collectives as C
from ..comm.ledger import CommLedger
from ..config import TrainConfig, load_config, resolve_config
from ..data import BatchPlan, load_split
from ..errors import NonFiniteError
from ..job_layout import JobLayout
from ..mesh import Axis, build_mesh, default_device, init_distributed
from ..models import Transformer
from ..parallel import context_of, parallelize
from ..parallel.compile import apply_compile
from ..parallel.recompute import apply_recompute
from ..pipeline.build import pipeline_rank_model
from ..theory.training import flops_per_token, mfu
from ..zero.reducer import build_reducer
from . import control
from .clip import clip_gradients, global_grad_norm
from .memory_meter import rss_now
from .metrics import RunFiles, device_peak_flops, format_postfix, peak_memory_bytes
from .optim import build_optimizer, set_lr
from .precision import Precision
from .schedule import lr_at


def world_axis(ledger=None) -> Axis:
    """All ranks as one :class:`Axis` (for gathering metrics), recording into ``ledger``."""
    n, r = dist.get_world_size(), dist.get_rank()
    return Axis("world", n, r, tuple(range(n)), dist.group.WORLD if n > 1 else None, ledger)


class Trainer:
    """Builds mesh, model (plain, on the meta device, then :func:`gridshard.parallelize`),
    optimizer and data plan from a validated config."""

    def __init__(self, config, run_dir: Optional[str] = None, progress: bool = True, overrides=()):
        if not dist.is_initialized():
            init_distributed(timeout_s=load_config(config, overrides).train.collective_timeout_s)
        world = dist.get_world_size()
        self.device = default_device()
        cfg: TrainConfig = resolve_config(config, overrides, world_size=world,
                                          cuda_available=self.device.type == "cuda")
        self.cfg, p, t = cfg, cfg.parallel, cfg.train
        self.rank = dist.get_rank()
        if world > 1:              # rank 0's run directory for all (e.g. timestamped defaults under torchrun)
            box = [run_dir]
            dist.broadcast_object_list(box, 0)
            run_dir = box[0]
        self.run_dir = run_dir
        # resume: decided from files every rank reads alike, checked before anything is built
        self.resume_from = resume_folder(t.resume, run_dir)
        self.layout_changes = []
        if self.resume_from is not None:
            from ..checkpoint.files import read_meta

            saved = read_meta(self.resume_from)
            self.layout_changes = check_compatible(saved["config"], cfg.resolved(), describe(self.resume_from),
                                                   start_step=saved.get("step"))
        self.ledger = CommLedger()                     # this job's collectives only (its mesh records here)
        self.mesh = build_mesh(p.data, p.pipeline, p.tensor, p.tensor_mode, ledger=self.ledger)
        # what the process holds before the model exists (Python, torch, gloo): the prediction's base
        self.mem_baseline = rss_now() if self.device.type == "cpu" else 0
        self.model_cfg = cfg.model.resolve()
        mc = self.model_cfg
        self.job = JobLayout.from_config(cfg, mc)      # every derived layout fact, decided once
        if cfg.model.hf_config is not None:
            from ..models.hf import build_hf_causal_lm

            plain = build_hf_causal_lm(cfg.model.hf_config, device="meta")
        else:
            with torch.device("meta"):
                plain = Transformer(mc)
        if p.pipeline > 1:                             # this rank's stages only, single-device names
            plain = pipeline_rank_model(plain, self.mesh, self.job.split)
        # values are a function of (seed, name, global index): the same global model at every layout
        self.model = parallelize(plain, self.mesh, sequence_parallel=p.sequence_parallel, seed=t.seed,
                                 device=self.device, summa_overlap=p.summa_overlap,
                                 # zero bubble defers the weight pass: nothing to overlap dx's collective with
                                 overlap_input_grad=p.overlap_input_grad and p.pipeline_schedule != "zero_bubble")
        self.context = context_of(self.model)
        if t.compile:                                  # before recompute, which wraps the compiled forward
            apply_compile(self.model)
        apply_recompute(self.model, t.recompute)
        named = [(n, q) for n, q in self.model.named_parameters() if q.requires_grad]
        self.params = [q for _, q in named]
        self.param_specs = [self.context.layouts[n] for n, _ in named]     # clipping reads the layouts
        self.faults = FaultPlan.from_env()
        needs_checkpoints = run_dir is not None or self.resume_from is not None or cfg.model.init_from is not None
        self.checkpointer = Checkpointer(run_dir, t.keep_checkpoints, self.faults) if needs_checkpoints else None
        if self.resume_from is None and cfg.model.init_from is not None:
            self._init_from(cfg.model.init_from)       # into the whole blocks, before ZeRO shards them
        # the data-parallel reduction of train.zero's stage (gridshard.zero.reducer): what the optimizer
        # steps, what the norm counts and what a checkpoint holds all come from it
        self.reducer = build_reducer(self.model, self.mesh.data, t.zero, int(t.bucket_mb * 2**20),
                                     overlap=t.overlap_grad_reduce and p.pipeline == 1)
        offload = t.offload == "optimizer" and self.device.type == "cuda"
        if t.offload == "optimizer" and not offload:
            from ..zero import warn_offload_on_cpu

            warn_offload_on_cpu(self.device, self.rank)
        self.optimizer = build_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2), t.adam_eps,
                                         tensors=self.reducer.optimizer_tensors(), offload=offload)
        self.precision = Precision(t.precision, self.device)
        self.pipeline = self.tied = None
        if p.pipeline > 1:
            from ..pipeline import PipelineRunner, TiedEmbeddingSync

            self.tied = TiedEmbeddingSync(self.model, self.mesh, mc.tie_embeddings)
            self.pipeline = PipelineRunner(
                self.model, self.mesh, schedule=p.pipeline_schedule, split=self.job.split, micro_batch=t.micro_batch,
                n_microbatches=self.job.micro_batches, seq_len=cfg.data.seq_len,
                loss=lambda logits, targets: self.context.loss(logits, targets, self.ignore_index, reduction="sum"),
                precision=self.precision, device=self.device)
            counted = {id(q) for q in self.tied.counted(self.params)}
        else:
            counted = {id(q) for q in self.params}
        # the norm reads each reduced tensor with its parameter's layout (ZeRO: rows, once over data ranks)
        spec_of = {id(q): s for q, s in zip(self.params, self.param_specs)}
        norm_tensors = self.reducer.norm_tensors()
        self.norm_pairs = [(x, spec_of[id(q)]) for x, q in norm_tensors if id(q) in counted]
        self.clip_tensors = [x for x, _ in norm_tensors]
        self.start_step = 0
        if self.resume_from is not None:
            self._resume(self.resume_from)
        tokens, val_tokens = load_split(cfg.data)
        self.plan = BatchPlan(tokens, cfg.data.seq_len, t.global_batch, t.micro_batch, p.data,
                              self.mesh.data.rank, t.seed, mc.vocab_size, cfg.data.ignore_token)
        self.val_plan = None if val_tokens is None else BatchPlan(
            val_tokens, cfg.data.seq_len, t.global_batch, t.micro_batch, p.data, self.mesh.data.rank, t.seed,
            mc.vocab_size, cfg.data.ignore_token, stream=1)
        self.ignore_index = -100 if cfg.data.ignore_token is None else cfg.data.ignore_token
        self.step_valid_tokens = None                  # N of the last step (valid targets, global batch)
        self.skipped_steps = 0                         # updates dropped by train.on_nonfinite=skip
        self.skipped_recent: set = set()               # their step numbers since the last log step
        self.decay_steps = t.decay_steps or t.steps
        self.flops_token = flops_per_token(mc.vocab_size, mc.hidden, mc.layers, mc.ffn_hidden, cfg.data.seq_len,
                                           mc.kv_heads * mc.head_dim)
        self.peak_flops = device_peak_flops(self.device, t.precision)
        self.predicted_mem = self._predict_memory(tokens, val_tokens)
        self.files = RunFiles(run_dir, active=self.rank == 0,
                              keep_until_step=self.start_step if self.resume_from is not None else None,
                              log_to=t.log_to)
        self.files.write_config(cfg.resolved())
        self.progress = progress
        self.history: list = []                        # metrics records (every rank)

    def _predict_memory(self, tokens, val_tokens):
        """This rank's predicted peak bytes (:func:`gridshard.theory.memory.predict_rank_memory`),
        or None for a model the memory model does not describe (a Hugging Face model)."""
        if self.cfg.model.hf_config is not None:
            return None
        from ..theory.memory import predict_rank_memory

        p, t = self.cfg.parallel, self.cfg.train
        resident = [x for x in (tokens, val_tokens) if x is not None and not isinstance(x, np.memmap)]
        return predict_rank_memory(
            self.model_cfg, mode=self.job.mode, T=p.tensor, sequence_parallel=self.job.sequence_parallel, data=p.data,
            data_rank=self.mesh.data.rank, zero=t.zero, recompute=t.recompute, micro_batch=t.micro_batch,
            seq_len=self.cfg.data.seq_len, n_microbatches=self.job.micro_batches,
            pipeline=p.pipeline, pipeline_rank=self.mesh.pipeline.rank, schedule=p.pipeline_schedule,
            layer_ids=[int(i) for i in self.model.layers.keys()] if p.pipeline > 1 else None,
            baseline_bytes=self.mem_baseline,
            extra_bytes=sum(int(getattr(x, "nbytes", 0)) for x in resident) if self.device.type == "cpu" else 0)

    # ---- checkpoints -------------------------------------------------------------------
    def _resume(self, folder: str) -> None:
        meta = self.checkpointer.load(folder, self.model, self.optimizer, reducer=self.reducer)
        if hasattr(self.optimizer, "reload_from_device"):
            self.optimizer.reload_from_device()
        self.start_step = int(meta["step"])
        G = self.cfg.train.global_batch
        if int(meta["samples"]) != self.start_step * G:
            from ..checkpoint import CheckpointError

            raise CheckpointError(f"checkpoint {describe(folder)}: data position {meta['samples']} samples is not "
                                  f"step × global_batch = {self.start_step}×{G}. Fix: resume with the global batch "
                                  f"it was written with.")
        if self.precision.scaler is not None and meta.get("loss_scaler"):
            self.precision.scaler.load_state_dict(meta["loss_scaler"])
        if self.rank == 0:
            changed = "; changes: " + ", ".join(self.layout_changes) if self.layout_changes else ""
            print(f"gridshard: resumed from {folder} at step {self.start_step}{changed}", file=sys.stderr)

    def _init_from(self, path: str) -> None:
        """``model.init_from``: the weights only, into the whole blocks of this rank — it runs
        before ZeRO shards them and before the optimizer exists, so a gridshard checkpoint is
        read through the verifying reader's model-only path (no optimizer, generator or step)."""
        from ..checkpoint.hf_io import is_gridshard_checkpoint, load_hf_blocks

        if is_gridshard_checkpoint(path):
            self.checkpointer.load_weights(path, self.model)
        else:
            load_hf_blocks(self.model, path, hf_names=self.cfg.model.hf_config is not None)

    def save_checkpoint(self, step: int, blocking: bool = False) -> None:
        """Checkpoint the state after ``step`` optimizer steps (asynchronous unless ``blocking``)."""
        t, p = self.cfg.train, self.cfg.parallel
        scaler = self.precision.scaler
        meta = {"tokens": step * t.global_batch * self.cfg.data.seq_len, "samples": step * t.global_batch,
                "loss_scaler": scaler.state_dict() if scaler is not None else None,
                "layout": {"data": p.data, "pipeline": p.pipeline, "tensor": p.tensor, "tensor_mode": p.tensor_mode,
                           "sequence_parallel": p.sequence_parallel},
                "config": self.cfg.resolved(), "saved_unix_time": time.time()}
        self.checkpointer.save(step, self.model, self.optimizer, meta, blocking=blocking, reducer=self.reducer)

    # ---- one optimizer step -----------------------------------------------------------
    def step(self, k: int):
        """Run optimizer step ``k``; returns (this data rank's share of the step's loss — the
        sum over data ranks is the global loss; NaN when the step has no valid target —,
        global grad norm, lr) as tensors/floats without synchronising the host. The step's
        global valid-target count N is left in ``self.step_valid_tokens``."""
        t = self.cfg.train
        lr = lr_at(k, t.lr, t.min_lr, t.warmup_steps, self.decay_steps, t.schedule)
        set_lr(self.optimizer, lr)
        self.reducer.zero_grad()                       # persistent gradient buffers are zeroed, not dropped
        micro, n_valid = self.plan.step_batches(k)
        self.step_valid_tokens = n_valid
        if n_valid == 0 and self.rank == 0:            # every rank knows; each runs the step with weight 0
            warnings.warn(f"step {k + 1}: every target of the global batch is data.ignore_token="
                          f"{self.cfg.data.ignore_token}; the step's gradient is zero and its loss is "
                          f"reported as null", RuntimeWarning, stacklevel=2)
        weight = self.mesh.data.size / n_valid if n_valid else 0.0      # D/N (module docstring)
        with self.context.vector_cache.window():       # parameters are fixed until the optimizer step
            sums = self._forward_backward(micro, weight)
        self.reducer.sync()
        self.precision.unscale(self.optimizer)
        norm = global_grad_norm([q for q, _ in self.norm_pairs], self.mesh, [s for _, s in self.norm_pairs],
                                pipeline_axis=self.mesh.pipeline,
                                data_axis=self.reducer.norm_axis)
        self.precision.agree_on_overflow(self.optimizer, norm)
        if self._skip_nonfinite(k, norm, sums):        # on_nonfinite=skip: the update is dropped
            self.reducer.zero_grad()
        else:
            clip_gradients(self.clip_tensors, norm, t.grad_clip)
            self.precision.step(self.optimizer)
            self.reducer.after_step()                  # ZeRO-1/2: all-gather the updated rows
        if not sums:                                   # a pipeline rank without the last stage
            share = torch.zeros((), dtype=torch.float64, device=self.device)
        else:
            share = torch.stack(sums).double().sum() / n_valid if n_valid else \
                torch.full((), float("nan"), dtype=torch.float64, device=self.device)
        return share, norm, lr

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
        """Whether some data rank's micro-batch loss of this step is NaN/inf (one MAX all-reduce
        over data and pipeline ranks, not in the ledger; every rank gets the same answer)."""
        bad = bool(sums) and not bool(torch.isfinite(torch.stack(sums)).all())
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        with self.ledger.paused():
            flag = C.all_reduce(C.all_reduce(flag, self.mesh.data, op="max"), self.mesh.pipeline, op="max")
        return bool(flag[0] > 0)

    def _last_checkpoint(self) -> str:
        """The last complete checkpoint, for messages (after the save in flight is done)."""
        if self.checkpointer is None or self.checkpointer.root is None:
            return self.resume_from or "none (no run directory)"
        from ..checkpoint.files import read_latest

        try:
            latest = read_latest(self.checkpointer.root)
        except Exception:                              # noqa: BLE001 (a message must not fail)
            latest = None
        return latest or self.resume_from or "none was written"

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

    def _forward_backward(self, micro: list, weight: float) -> list:
        """Every micro-batch's forward and backward (the pipeline schedule's, or one after the
        other), gradients scaled by ``weight``; returns the detached loss sums."""
        if self.pipeline is not None:                  # the schedule runs every micro-batch's forward/backward
            sums = self.pipeline.run(micro, weight, self.device)
            self.tied.sync()
            return sums
        sums = []
        for a, (tokens, targets) in enumerate(micro):
            if a == len(micro) - 1:
                self.reducer.arm()                     # reduce buckets/units during the last backward
            tokens = self.context.shard_tokens(tokens).to(self.device, non_blocking=True)
            targets = self.context.shard_tokens(targets).to(self.device, non_blocking=True)
            with self.precision.autocast():
                loss_sum = self.context.model_loss(self.model, tokens, targets, self.ignore_index, reduction="sum")
            self.precision.scale(loss_sum * weight).backward()
            sums.append(loss_sum.detach())
        return sums

    def evaluate(self) -> Optional[float]:
        """The validation loss (module docstring), the same value on every rank; None without
        validation data or when no validation target is valid."""
        if self.val_plan is None:
            return None
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        n = 0
        with torch.no_grad():
            for j in range(self.cfg.train.eval_batches):
                micro, n_valid = self.val_plan.step_batches(j)
                n += n_valid
                if self.pipeline is not None:          # forward only through the stages
                    for loss_sum in self.pipeline.evaluate(micro, self.device):
                        total += loss_sum.double()
                    micro = []
                for tokens, targets in micro:
                    tokens = self.context.shard_tokens(tokens).to(self.device, non_blocking=True)
                    targets = self.context.shard_tokens(targets).to(self.device, non_blocking=True)
                    with self.precision.autocast():
                        loss_sum = self.context.model_loss(self.model, tokens, targets, self.ignore_index,
                                                           reduction="sum")
                    total += loss_sum.double()
        self.reducer.free_all()                        # ZeRO-3: the root stays gathered after a forward
        with self.ledger.paused():
            total = C.all_reduce(total.reshape(1), self.mesh.data)
            total = C.all_reduce(total, self.mesh.pipeline)      # only the last stage holds sums
        return float(total[0]) / n if n else None

    def _global_losses(self, local: list) -> list:
        """Sum over data ranks of each step's loss share, from (share, N) pairs (one all-reduce,
        not in the ledger); None for a step without valid targets (N = 0)."""
        with self.ledger.paused():
            vec = C.all_reduce(torch.stack([x for x, _ in local]).double(), self.mesh.data)
            vec = C.all_reduce(vec, self.mesh.pipeline)          # only the last stage holds losses
        return [None if n == 0 else x for x, (_, n) in zip(vec.cpu().tolist(), local)]

    def _meter_marks(self) -> tuple:
        m = self.pipeline.meter if self.pipeline is not None else None
        return (m.busy_s, m.schedule_s) if m is not None else (0.0, 0.0)

    def _gather_rank_stats(self, comm_s: float, wall_s: float, busy: tuple = (0.0, 0.0)) -> tuple:
        """(mean communication share, peak memory per rank, pipeline bubble share per rank,
        predicted peak memory per rank);
        ``busy``: (time in stage forward/backward, wall time in the schedule) of the interval."""
        idle = 1.0 - busy[0] / max(busy[1], 1e-12) if self.pipeline is not None else 0.0
        predicted = float(self.predicted_mem.total) if self.predicted_mem is not None else -1.0
        stats = torch.tensor([[comm_s / max(wall_s, 1e-12), float(peak_memory_bytes(self.device)), idle, predicted]],
                             dtype=torch.float64, device=self.device)
        with self.ledger.paused():
            allr = C.all_gather(stats, world_axis(self.ledger), dim=0).cpu()
        bubble = [float(x) for x in allr[:, 2]] if self.pipeline is not None else None
        predicted = [int(x) for x in allr[:, 3]] if self.predicted_mem is not None else None
        return float(allr[:, 0].mean()), [int(x) for x in allr[:, 1]], bubble, predicted

    # ---- stopping on request (gridshard.engine.control) ---------------------------------
    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGINT) by now: one all-reduce (MAX) of a
        one-element flag over the world, not in the ledger, so all ranks stop after the same step."""
        flag = torch.tensor([1.0 if control.stop_requested() else 0.0], device=self.device)
        with self.ledger.paused():
            return bool(C.all_reduce(flag, world_axis(self.ledger), op="max")[0] > 0)

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
        tokens_per_step = t.global_batch * self.cfg.data.seq_len
        prev_timing = self.ledger.timing
        time_comm = t.time_comm if t.time_comm is not None else self.device.type != "cuda"
        self.ledger.timing = time_comm
        bar = tqdm(total=t.steps, disable=not (self.progress and self.rank == 0), file=sys.stderr,
                   dynamic_ncols=True, desc="train")
        all_losses, pending = [], []
        start = last = time.perf_counter()
        bar.update(self.start_step)
        saving = self.checkpointer is not None and self.checkpointer.root is not None
        stoppable = control.stop_installed()           # the same on every rank (install_stop_handler)
        comm_at_last, steps_at_last = self.ledger.seconds(), self.start_step
        busy_at_last = self._meter_marks()
        try:
            for k in range(self.start_step, t.steps):
                loss, norm, lr = self.step(k)
                pending.append((loss, self.step_valid_tokens))
                bar.update(1)
                hit(self.faults, "step", self.rank, k + 1)
                if saving and t.save_interval and (k + 1) % t.save_interval == 0:
                    self.save_checkpoint(k + 1)
                is_eval = self.val_plan is not None and (
                    (t.eval_interval and (k + 1) % t.eval_interval == 0) or k + 1 == t.steps)
                log_step = not ((k + 1) % t.log_interval and k + 1 != t.steps and not is_eval)
                # a stop request is agreed on at every step end on CPU (one tiny gloo all-reduce), at
                # log steps on GPUs (reading the flag synchronises the host with the device)
                stop = stoppable and (log_step or self.device.type == "cpu") and self._stop_agreed() \
                    and k + 1 != t.steps
                if not (log_step or stop):
                    continue
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                wall, n_steps = now - last, k + 1 - steps_at_last
                busy = (self.pipeline.meter.busy_s - busy_at_last[0], self.pipeline.meter.schedule_s - busy_at_last[1]) \
                    if self.pipeline is not None else (0.0, 0.0)
                comm_share, mems, bubble, predicted = self._gather_rank_stats(self.ledger.seconds() - comm_at_last, wall, busy)
                losses = self._global_losses(pending)
                all_losses += losses
                # the loss is known globally only here (its sum over data ranks): a non-finite one
                # with a finite gradient norm (every step's check) is rare, and is acted on now
                nonfinite = [(steps_at_last + 1 + i, x) for i, x in enumerate(losses)
                             if x is not None and not math.isfinite(x) and steps_at_last + 1 + i not in
                             self.skipped_recent]
                self.skipped_recent.clear()
                tps = n_steps * tokens_per_step / wall
                rec = {"step": k + 1, "loss": losses[-1], "valid_tokens": self.step_valid_tokens,
                       "lr": lr, "grad_norm": float(norm),
                       "tokens_per_s": tps, "mfu": mfu(self.flops_token, tps, self.peak_flops, dist.get_world_size()),
                       "comm_share": comm_share if time_comm else None, "peak_mem_bytes": max(mems),
                       "peak_mem_bytes_per_rank": mems,
                       "predicted_mem_bytes": max(predicted) if predicted else None,
                       "predicted_mem_bytes_per_rank": predicted, "step_time_s": wall / n_steps,
                       "tokens": (k + 1) * tokens_per_step, "elapsed_s": now - start,
                       "loss_scale": self.precision.loss_scale(), "skipped_steps": self.skipped_steps,
                       "bubble_share": max(bubble) if bubble else None, "bubble_share_per_rank": bubble}
                if is_eval:
                    rec["val_loss"] = self.evaluate()
                self.history.append(rec)
                self.files.append(rec)
                bar.set_postfix(format_postfix(rec), refresh=False)
                pending, last, steps_at_last = [], time.perf_counter(), k + 1
                comm_at_last = self.ledger.seconds()
                busy_at_last = self._meter_marks()
                if nonfinite and t.on_nonfinite == "stop":
                    raise self._diverged(nonfinite[0][0], f"the loss is {nonfinite[0][1]} (found at the log step "
                                                          f"{k + 1}; its gradient norm was finite)")
                if nonfinite and self.rank == 0:
                    warnings.warn(f"step {nonfinite[0][0]}: the loss is {nonfinite[0][1]} with a finite gradient "
                                  f"norm: its update was taken (train.on_nonfinite=skip acts on non-finite gradient "
                                  f"norms)", RuntimeWarning, stacklevel=2)
                if stop:
                    raise self._stopped(k + 1, saving, all_losses)
            if saving and t.steps > self.start_step and self.checkpointer.last_requested != t.steps:
                self.save_checkpoint(t.steps, blocking=True)      # the end of the run is always saved
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            bar.close()
            self.files.close()
            self.ledger.timing = prev_timing
        return all_losses


def train(config=None, run_dir: Optional[str] = None, overrides=(), progress: bool = False) -> list:
    """Validate ``config`` against this process group, train, return the per-step global losses
    (the same list on every rank). ``config``: YAML path, dict, TrainConfig or None (default)."""
    return Trainer(config, run_dir=run_dir, progress=progress, overrides=overrides).run()
