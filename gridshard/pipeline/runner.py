"""One optimizer step's forward and backward through the pipeline, on PyTorch's schedules.

Built on ``torch.distributed.pipelining``: each of this rank's stages is a
``PipelineStage`` over a :class:`gridshard.pipeline.stage_module.StageModule`, on the
mesh's pipeline group (the P ranks with this rank's data and tensor coordinates: tensor
rank t of stage i talks to tensor rank t of stage i+1, each sending its own activation
block; 2.5D: grid position (k, i, j) of depth layer k sends its [m/(d·q), s, h/q] block to
(k, i, j) of the next stage), and ``parallel.pipeline_schedule`` picks the schedule:

===================  ==========================================  =========================
name                 PyTorch schedule                            stages per rank
===================  ==========================================  =========================
``gpipe``            ``ScheduleGPipe``                           1
``1f1b``             ``Schedule1F1B``                            1
``interleaved_1f1b`` ``ScheduleInterleaved1F1B``                 ``virtual_stages`` ≥ 2
``zero_bubble``      ``ScheduleInterleavedZeroBubble``           ``virtual_stages`` ≥ 2
===================  ==========================================  =========================

Zero bubble splits each backward into an input-gradient pass and a deferred weight-gradient
pass. It is exact with gridshard's tensor-parallel autograd Functions and does not repeat
their collectives in the weight pass: ``tests/test_pipeline.py`` checks the losses against
one device and the ledger's tensor-group collectives against interleaved 1F1B's (equal).
The weight pass starts at the autograd nodes where a weight meets the stage's input (the
projections' matmuls, the norms' products) and goes down to the weights only, so a
weightless node between them, such as the context attention (ring or all-to-all, sends
included), runs once, in the input pass; every schedule at C > 1 equals one process
(``tests/test_context_training.py``, which also counts the context sends).

The step's A = G/(D·m) micro-batches of this data rank are the pipeline's micro-batches:
their tokens (2D: each micro-batch's grid-row block; 2.5D: block k·q + i of d·q; ``shard_tokens``) are concatenated
and the schedule cuts them back into A chunks. The last stage's loss function is the
trainer's: the micro-batch's loss *sum* over valid targets times D/N (N: valid targets of
the global batch), with ``scale_grads=False``, so the gradients are exactly those of the
non-pipelined step (:mod:`gridshard.engine.step`). Stage-to-stage activation sends are
the schedule's point-to-point operations; their bytes per micro-batch and boundary are
:func:`gridshard.theory.pipeline.boundary_bytes`, and :class:`gridshard.pipeline.meter.StageMeter`
records them in the ledger and measures busy time (the bubble), micro-batches in flight and
saved activation bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..device import batch_to_device
from ..errors import ConfigError
from ..job_layout import StageSplit
from ..parallel.parallelize import model_dims
from ..torch_private import answer_stage_votes, receive_just_in_time
from .meter import StageMeter
from .send_release import SendRelease
from .stage_module import StageModule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class PipelineRunner:
    """This rank's stages and schedule (module docstring)."""

    def __init__(self, rank_model, mesh, *, schedule: str, split: StageSplit, micro_batch: int,
                 n_microbatches: int, seq_len: int, loss, precision, device):
        """``split``: the job layout's stage → layers split (:class:`gridshard.job_layout.StageSplit`)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

        ctx = rank_model.parallel_context
        hidden = model_dims(rank_model).hidden
        S, V, ids = split.stages, split.virtual_stages, split.layer_ids()
        self.stage_indices = split.stages_of_rank(mesh.pipeline.rank)
        self.ctx, self.loss, self.precision = ctx, loss, precision
        self.has_last = split.holds_last(mesh.pipeline.rank)
        self.has_first = split.holds_first(mesh.pipeline.rank)
        # one micro-batch's activation block at a stage boundary, in the job's mode and T (2.5D: d layers of
        # q², each its 2D block of m/d rows: [m/(d·q), s, h/q]); block[0]: my token rows
        block = mesh.job_mode.boundary_block(mesh.sizes[2], ctx.sequence_parallel, micro_batch, seq_len, hidden,
                                             mesh.tensor_depth)
        micro_local = block[0]
        # hidden states between stages: the compute dtype for gridshard's model (Transformer.hidden_dtype); the
        # parameters' for a family whose residual stream is its embedding's output under autocast (Hugging
        # Face's: fp32 over fp32 parameters, bf16 under bf16 storage; declared fp32 there, the receiving stage
        # read a bf16 send into an fp32 buffer, half of it garbage)
        hidden_dtype = getattr(rank_model, "hidden_dtype", lambda compute: precision.param_dtype)(precision.dtype)
        act = torch.empty(block, dtype=hidden_dtype, device="meta", requires_grad=True)
        tokens = rank_model.stage_input_meta(micro_local, seq_len)
        self.meter = StageMeter(mesh.pipeline if mesh.ledger is not None else ctx.mesh.pipeline,
                                rank_model.parameters(), device)
        stages = []
        for s in self.stage_indices:
            first, last = s == 0, s == S - 1
            out = rank_model.stage_output_meta(micro_local, seq_len, mesh, precision.dtype) if last else act
            module = StageModule(rank_model, ids[s], first, last, seq_len, declared=out)
            stages.append(PipelineStage(module, s, S, device, input_args=(tokens if first else act,),
                                        output_args=(out,), group=mesh.pipeline.group))
            receive_just_in_time(stages[-1])          # a receive buffer only while its micro-batch needs it
            if dist.get_backend() == "fake":           # gridshard emulate: no peer answers the start-up vote
                answer_stage_votes(stages[-1])
            self.meter.attach(stages[-1])
        self.weight, self.sums = 0.0, []       # run's loss weight and the last stage's loss sums
        self.measure = None                  # evaluate(measure=…): what the last stage sums instead of the loss
        if schedule in ("interleaved_1f1b", "zero_bubble"):
            cls = ScheduleInterleaved1F1B if schedule == "interleaved_1f1b" else ScheduleInterleavedZeroBubble
            self.schedule = cls(stages, n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        elif schedule in ("gpipe", "1f1b"):
            if V != 1:
                raise ConfigError(f"parallel.pipeline_schedule={schedule} runs one stage per rank but "
                                  f"parallel.virtual_stages={V}. Fix: virtual_stages=1, or "
                                  f"pipeline_schedule=interleaved_1f1b.")
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        else:
            raise ConfigError(f"parallel.pipeline_schedule={schedule!r} is not one of {SCHEDULES}.")
        self.sends = SendRelease(self.schedule, stages, mesh.pipeline.rank)

    def _loss_fn(self, logits, targets):
        loss_sum = (self.measure or self.loss)(logits, targets)
        self.sums.append(loss_sum.detach())
        return self.precision.scale(loss_sum * self.weight)

    def run(self, micro: list, weight: float, device) -> list:
        """Forward and backward of this step's micro-batches [(tokens, targets) [m, s]]; each
        micro-batch's backward is of its loss sum × ``weight``. Returns the loss sums of the
        micro-batches on the rank with the last stage, else an empty list."""
        self.weight, self.sums = weight, []
        args, kwargs = self._schedule_inputs(micro, device)
        with self.meter.schedule.region(), self.precision.autocast():
            self.sends.step(lambda: self.schedule.step(*args, **kwargs))
        return self.sums

    def _schedule_inputs(self, micro: list, device) -> tuple:
        """(args, kwargs) of the schedule's step or eval: this rank's tokens of every micro-batch,
        concatenated, where it has the first stage; their targets where it has the last; packed
        windows' document ids on every rank (the schedule cuts them per micro-batch and hands each
        stage its chunk, ``StageModule.forward(x, documents)``)."""
        args, kwargs = (), {}
        if self.has_first:
            args = (batch_to_device(torch.cat([self.ctx.shard_tokens(mb[0]) for mb in micro]), device),)
        if self.has_last:
            kwargs = {"target": batch_to_device(torch.cat([self.ctx.shard_targets(mb[1]) for mb in micro]), device),
                      "losses": []}
        if len(micro[0]) > 2:              # packed windows: every stage reads the document ids (a stage kwarg)
            kwargs["documents"] = batch_to_device(torch.cat([self.ctx.shard_documents(mb[2]) for mb in micro]),
                                                  device)
        return args, kwargs

    def evaluate(self, micro: list, device, measure=None) -> list:
        """Forward only (the schedule's ``eval``): the loss sums of ``micro`` on the rank with
        the last stage, else an empty list; with ``measure(logits, targets) -> tensor`` (called by
        every tensor rank of the last stage, in micro-batch order) its values instead of the
        loss sums (a classifier's right answers: :func:`gridshard.engine.step.accuracy_metrics`)."""
        self.weight, self.sums, self.measure = 1.0, [], measure
        args, kwargs = self._schedule_inputs(micro, device)
        try:
            with torch.no_grad(), self.precision.autocast():
                self.schedule.eval(*args, **kwargs)
            return self.sums
        finally:
            self.measure = None
