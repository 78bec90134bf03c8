"""One optimizer step of a composed job: ``train_step(job, batch)``, and the evaluation pass.

One optimizer step k, on data rank d of D with A = G/(m·D) micro-batches::

    lr ← schedule(k)                                         (train.schedule: warm-up, decay)
    N  ← valid targets of step k's whole global batch       (batch.valid_targets: every
                                                              rank counts it, no communication;
                                                              record sources: one all-reduce over
                                                              data ranks, data.record_rows)
    for each of my A micro-batches a (tokens, targets[, document ids]) [m, s]:  (2D: context.shard_tokens → [m/q, s])
        L_da = context.model_loss(..., reduction="sum")      Σ ℓ_i over the micro-batch's valid
                                                              targets (the tensor group's, same on
                                                              every tensor rank; 0 if none is valid)
        backward(L_da · D/N)                                  (× loss scale in fp16)
    grads ← mean over data ranks by the reducer of train.zero (gridshard.zero.reducer; issued
            during the last micro-batch's backward as each bucket/unit completes): ZeRO-0 an
            in-place all-reduce per bucket of the persistent gradient buffer (.grad are views of
            it); ZeRO ≥ 1 a reduce-scatter per layer unit, each data rank keeping its chunk's mean
    ‖g‖  ← global norm, every parameter once (one all-reduce over tensor; ZeRO: over data too)
    skip_update(k, ‖g‖, loss sums) ? drop the gradients :
        clip to train.grad_clip; AdamW step (ZeRO: on this rank's chunk, then ZeRO-1/2 all-gather them)

Context parallelism (C > 1 context ranks per data rank): each context rank's L_da covers only
its chunks of the micro-batch's sequences, parameters are replicated over data × context, and the
reducer averages over those D·C ranks (``mesh.data_context``); rank (d, c) backpropagates
(D·C/N)·Σ_a L_dca, so the mean over D·C ranks is again (1/N) Σ ∇L — D below stands for D·C.
The loss shares, evaluation sums and N are summed over ``data_context`` the same way.

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
(:mod:`gridshard.parallel.model_context`), never NaN.

The micro-batches are driven one way for every layout: ``job.driver`` is a
:class:`MicroBatchLoop` (P = 1: one micro-batch after the other on the whole model, the
reducer armed for the last backward) or a :class:`PipelineSchedule` (P > 1: the pipeline
schedule over this rank's stages, then the tied embedding's gradient sync). Both also run
forward only, which :func:`evaluate` uses.

A batch (:class:`StepBatch`, ``job.batch(k)``) is what the data plan
gives this rank for step k: the step number (for the learning rate), this rank's A
micro-batches ``[(tokens, targets) [m, s]]`` and N.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..comm import collectives as C
from ..device import batch_to_device
from .clip import clip_gradients, global_grad_norm
from .optim import set_lr
from .profiling import Ranges
from ..schedule import lr_at


@dataclass(frozen=True)
class StepBatch:
    """This rank's data of optimizer step ``step``: ``micro`` its micro-batches
    ``[(tokens, targets) [m, s]]``, ``valid_targets`` N of the whole global batch."""

    step: int
    micro: list
    valid_targets: int


@dataclass
class StepResult:
    """What :func:`train_step` returns, without synchronising the host: ``loss_share`` this
    data rank's share (1/N) Σ_a L_da of the step's loss (float64 tensor; the sum over data
    ranks — :func:`global_losses` — is the global loss; NaN when N = 0; 0 on a pipeline rank
    without the last stage), ``grad_norm`` the global gradient norm (before clipping),
    ``lr``, ``valid_targets`` N, ``loss_sums`` the micro-batches' detached loss sums and
    ``skipped`` whether the update was dropped by ``skip_update``."""

    loss_share: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    valid_targets: int
    loss_sums: list
    skipped: bool


class MicroBatchLoop:
    """P = 1: the micro-batches one after the other on the whole model."""

    def __init__(self, model, context, precision, reducer, ignore_index: int, device, ranges=None):
        self.model, self.context, self.precision = model, context, precision
        self.reducer, self.ignore_index, self.device = reducer, ignore_index, device
        self.ranges = ranges if ranges is not None else Ranges()     # profiler ranges (engine.profiling)

    def _loss_sum(self, tokens, targets, documents=None) -> torch.Tensor:
        tokens = batch_to_device(self.context.shard_tokens(tokens), self.device)   # 2D: this grid row's rows
        targets = batch_to_device(self.context.shard_targets(targets), self.device)   # 3D: the logits' rows
        if documents is not None:                                                  # packed windows' ids
            documents = batch_to_device(self.context.shard_documents(documents), self.device)
        with self.precision.autocast():
            return self.context.model_loss(self.model, tokens, targets, self.ignore_index, reduction="sum",
                                           documents=documents)

    def forward_backward(self, micro: list, weight: float) -> list:
        """Forward and backward of every micro-batch (the backward of loss sum × ``weight``),
        the reducer armed for the last one; returns the detached loss sums."""
        sums = []
        for a, batch in enumerate(micro):
            if a == len(micro) - 1:
                self.reducer.arm()                     # reduce buckets/units during the last backward
            with self.ranges("gridshard.forward", a):
                loss_sum = self._loss_sum(*batch)
            with self.ranges("gridshard.backward", a):
                self.precision.scale(loss_sum * weight).backward()
            sums.append(loss_sum.detach())
        return sums

    def forward(self, micro: list) -> list:
        """Forward only: the loss sums of ``micro`` (call under ``torch.no_grad``)."""
        return [self._loss_sum(*batch) for batch in micro]


class PipelineSchedule:
    """P > 1: the pipeline schedule over this rank's stages (:class:`gridshard.pipeline.PipelineRunner`)."""

    def __init__(self, runner, tied, device):
        self.runner, self.tied, self.device = runner, tied, device

    def forward_backward(self, micro: list, weight: float) -> list:
        """The schedule's forward and backward of every micro-batch, then the tied embedding's
        gradient sync; the loss sums on the rank with the last stage, else ``[]``."""
        sums = self.runner.run(micro, weight, self.device)
        self.tied.sync()
        return sums

    def forward(self, micro: list) -> list:
        """Forward only through the stages: the loss sums on the last stage's rank, else ``[]``."""
        return self.runner.evaluate(micro, self.device)


def train_step(job, batch: StepBatch, skip_update: Optional[Callable] = None) -> StepResult:
    """Run optimizer step ``batch.step`` of ``job`` (:func:`gridshard.build_job`) on ``batch``
    (module docstring); collective: every rank of the job calls it with its own batch of the
    same step. ``skip_update(step, grad_norm, loss_sums) -> bool`` decides, after the gradient
    norm is known and before any update, whether the step's update is dropped (gradients
    zeroed, no optimizer step); it may raise to stop the run. Without it every update is taken
    (fp16: the loss scaler still skips overflowing steps). Returns a :class:`StepResult`."""
    t, n_valid = job.cfg.train, batch.valid_targets
    lr = lr_at(batch.step, t.lr, t.min_lr, t.warmup_steps, job.decay_steps, t.schedule)
    set_lr(job.optimizer, lr)
    job.reducer.zero_grad()                            # persistent gradient buffers are zeroed, not dropped
    if n_valid == 0 and job.rank == 0:                 # every rank knows; each runs the step with weight 0
        warnings.warn(f"step {batch.step + 1}: every target of the global batch is data.ignore_token="
                      f"{job.cfg.data.ignore_token}; the step's gradient is zero and its loss is "
                      f"reported as null", RuntimeWarning, stacklevel=3)
    weight = job.mesh.data_context.size / n_valid if n_valid else 0.0      # D·C/N (C = 1: D/N)
    if job.moe is not None:
        job.moe.begin(job.precision.loss_scale())
    with job.context.vector_cache.window():            # parameters are fixed until the optimizer step
        sums = job.driver.forward_backward(batch.micro, weight)
    with job.ranges("gridshard.grad_reduce"):
        job.reducer.sync()
    job.precision.unscale(job.optimizer)
    norm = global_grad_norm([q for q, _ in job.norm_pairs], job.mesh, [s for _, s in job.norm_pairs],
                            pipeline_axis=job.mesh.pipeline, data_axis=job.reducer.norm_axis,
                            expert_axis=job.reducer.expert_norm_axis)
    job.precision.agree_on_overflow(job.optimizer, norm)
    skipped = bool(skip_update is not None and skip_update(batch.step, norm, sums))
    if skipped:
        job.reducer.zero_grad()
    else:
        with job.ranges("gridshard.optimizer"):
            clip_gradients(job.clip_tensors, norm, t.grad_clip)
            job.precision.step(job.optimizer)
            job.reducer.after_step()                   # ZeRO-1/2: all-gather the updated chunks
    if job.moe is not None:
        job.moe.end(update_bias=not skipped)           # the routing statistics, bias update, metrics
    if job.warmup is not None:                         # train.compile: compiled; back to collective_timeout_s
        job.warmup.done("step")
    return StepResult(_loss_share(sums, n_valid, job.device), norm, lr, n_valid, sums, skipped)


def _loss_share(sums: list, n_valid: int, device) -> torch.Tensor:
    """(1/N) Σ_a L_da in float64; 0 on a pipeline rank without the last stage; NaN when N = 0."""
    if not sums:
        return torch.zeros((), dtype=torch.float64, device=device)
    if not n_valid:
        return torch.full((), float("nan"), dtype=torch.float64, device=device)
    return torch.stack(sums).double().sum() / n_valid


def global_losses(job, results: List[tuple]) -> list:
    """The global loss of each step from ``(loss_share, N)`` pairs: the sum over data ranks
    (one all-reduce over data and one over pipeline ranks, paused in the ledger); None for a
    step without valid targets (N = 0). The same list on every rank."""
    with job.ledger.paused():
        vec = C.all_reduce(torch.stack([x for x, _ in results]).double(), job.mesh.data_context, inplace=True)
        vec = C.all_reduce(vec, job.mesh.pipeline, inplace=True)        # only the last stage holds losses
    return [None if n == 0 else x for x, (_, n) in zip(vec.cpu().tolist(), results)]


def accuracy_metrics(job) -> dict:
    """A classifier's (``parallel_context.objective == "classify"``, the ViT) ``accuracy`` and
    ``val_accuracy``: the share of right answers (argmax = label) over the first
    ``train.eval_batches`` global batches of the training data (batches 0, 1, … of the run's order,
    the same every time) and of the validation data; {} for a language model. Forward only,
    the same values on every rank (all-reduces over data (× 2.5D depth) and pipeline ranks and, in
    2D, along the grid column; paused in the ledger). P > 1: the pipeline's forward, counted at the last stage."""
    if job.context.objective != "classify":
        return {}
    out = {"accuracy": _accuracy(job, job.plan)}
    if job.val_plan is not None:
        out["val_accuracy"] = _accuracy(job, job.val_plan)
    return out


def _accuracy(job, plan) -> float:
    ctx, hits, n = job.context, torch.zeros((), dtype=torch.float64, device=job.device), 0
    with torch.no_grad(), job.ledger.paused():
        for j in range(job.cfg.train.eval_batches):
            micro, n_valid = plan.step_batches(j)
            n += n_valid
            if job.pipeline is not None:                # P > 1: counted at the last stage (its rank only)
                count = lambda logits, y: ctx.mode.correct_count(logits, y, ctx.mesh)      # noqa: E731
                hits += sum(c.double() for c in job.pipeline.evaluate(micro, job.device, measure=count))
                continue
            for images, labels in micro:
                images = batch_to_device(ctx.shard_tokens(images), job.device)
                labels = batch_to_device(ctx.shard_tokens(labels), job.device)
                with job.precision.autocast():
                    hits += ctx.mode.correct_count(ctx.logits(job.model, images), labels, ctx.mesh)
        job.reducer.free_all()                          # ZeRO-3: the root stays gathered after a forward
        hits = C.all_reduce(hits.reshape(1), job.mesh.data_context, inplace=True)     # 2.5D: × depth layers
        hits = C.all_reduce(hits, job.mesh.pipeline, inplace=True)      # P > 1: only the last stage counted
    return float(hits[0]) / n


def evaluate(job) -> Optional[float]:
    """The validation loss, the same value on every rank; None without validation data or when
    no validation target is valid:

        val_loss = (Σ_j Σ_{d,a} L_jda) / (Σ_j N_j)      over batches j < train.eval_batches

    with no gradient, through the job's micro-batch driver (forward only); one all-reduce over
    the data × context (× 2.5D depth) ranks, ``mesh.data_context``, each holding its own rows or
    sequence chunks, and one over pipeline ranks (paused in the ledger) sum the L's."""
    if job.val_plan is None:
        return None
    total = torch.zeros((), dtype=torch.float64, device=job.device)
    n = 0
    with torch.no_grad():
        for j in range(job.cfg.train.eval_batches):
            micro, n_valid = job.val_plan.step_batches(j)
            n += n_valid
            for loss_sum in job.driver.forward(micro):
                total += loss_sum.double()
    job.reducer.free_all()                             # ZeRO-3: the root stays gathered after a forward
    with job.ledger.paused():
        total = C.all_reduce(total.reshape(1), job.mesh.data_context, inplace=True)
        total = C.all_reduce(total, job.mesh.pipeline, inplace=True)        # only the last stage holds sums
    if job.warmup is not None:                         # train.compile: the no-grad graphs are compiled too
        job.warmup.done("eval")
    return float(total[0]) / n if n else None
