"""The composer: ``build_job(config)`` lays one rank's part of a training job out, in one order.

Every rank of the job (torchrun workers, the CLI's elastic workers, the test harness's gloo
groups) calls :func:`build_job` with the same config; it joins the process group if none is
initialised yet. The config is validated against the world once (:func:`resolve_job_config`;
a :class:`ResolvedConfig` — what the CLI hands its workers — is taken as it is), then the job
is composed in this fixed order, each stage reading only what the ones before it built
(torchtitan's ``parallelize_*`` order)::

    config ─ resolved once (world size) · rank 0's run directory · resume source checked
      ├─ math modes (train.tf32, train.deterministic: engine/precision.apply_math_modes)
      ├─ CommLedger (the job's) · build_mesh(D, P, T, mode) · JobLayout (every derived fact)
      1. model on meta       Transformer (or VisionTransformer, model.kind: vit), or Hugging Face
                             LlamaForCausalLM (model.hf_config)
      2. stage split         P > 1: this rank's stages only (pipeline_rank_model, JobLayout.split)
      3. parallelize         swap layers, materialise this rank's blocks (values: a function of
                             (seed, name, global index), or model.init_from into the whole blocks)
      4. recompute           train.recompute per decoder layer
      5. compile             train.compile: torch.compile per decoder layer
      6. reducer             build_reducer(model, mesh.data_context, train.zero, bucket bytes); bf16: fp32 masters,
                             then the parameters stored in bf16
      7. optimizer           AdamW over reducer.optimizer_tensors() · Precision (train.precision)
      8. checkpointer        Checkpointer (own gloo group) · train.resume into model, optimizer, reducer
      ├─ micro-batch driver  P = 1: MicroBatchLoop; P > 1: PipelineSchedule (PipelineRunner, tied sync)
      └─ norm pairs (each reduced gradient with its parameter's layout) · BatchPlans (train, validation;
                             ImagePlans for data.kind digits | images)

:data:`COMPOSITION_ORDER` names the eight stages; ``Job.composed`` records them as they ran.
One optimizer step is :func:`gridshard.engine.step.train_step`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer, CheckpointError, FaultPlan
from ..checkpoint.resume import check_compatible, describe, resume_folder
from ..comm.ledger import CommLedger
from ..config import TrainConfig, load_config, resolve_config
from ..data import BatchPlan, load_split
from ..data.packing import split_packers
from ..device import rank_device
from ..errors import ConfigError
from ..job_layout import JobLayout
from ..mesh import build_mesh, init_distributed
from ..models import Transformer
from ..models.vit import VisionTransformer
from ..moe.training import MoETraining
from ..parallel import context_of, parallelize
from ..parallel.compile import apply_compile
from ..parallel.recompute import apply_recompute
from ..pipeline.build import pipeline_rank_model
from ..pipeline.tied import holds_tied_copy
from ..theory.zero import reduces_in_backward
from ..zero.reducer import build_reducer
from .memory_meter import rss_now
from .profiling import Ranges
from .warmup import start_warmup
from .optim import build_optimizer
from .precision import DTYPES, Precision, apply_math_modes, param_dtype
from .step import MicroBatchLoop, PipelineSchedule, StepBatch

COMPOSITION_ORDER = ("model on meta", "stage split", "parallelize", "recompute", "compile", "reducer",
                     "optimizer", "checkpointer")


@dataclass(frozen=True)
class ResolvedConfig:
    """A config already validated for ``world_size`` processes (``cuda_available`` as the
    validation saw it): what the CLI's launcher hands its workers, so no rank loads, resolves
    or re-reads the data files' sizes a second time."""

    config: TrainConfig
    world_size: int
    cuda_available: bool


@dataclass
class Job:
    """One rank's part of a training job (module docstring), as :func:`build_job` composed it."""

    cfg: TrainConfig
    layout: JobLayout                        # every derived layout fact (gridshard.job_layout)
    model_cfg: Any                           # the resolved model shape (cfg.model.resolve())
    device: torch.device
    rank: int
    run_dir: Optional[str]
    resume_from: Optional[str]               # the checkpoint folder train.resume names, or None
    layout_changes: list                     # what differs from the checkpoint's layout
    ledger: CommLedger
    mesh: Any
    mem_baseline: int                        # the process's bytes before the model existed (CPU)
    data_bytes: int = 0                      # what loading the data added to them (CPU: imports, resident arrays)
    ranges: Ranges = field(default_factory=Ranges)    # gridshard's profiler ranges (engine.profiling)
    math_modes: dict = field(default_factory=dict)    # train.tf32 / train.deterministic in effect
    composed: list = field(default_factory=list)      # COMPOSITION_ORDER, as the stages ran
    model: Any = None
    context: Any = None                      # the model's ParallelContext
    params: list = field(default_factory=list)        # trainable parameters, in name order
    param_specs: list = field(default_factory=list)   # their layouts (ctx.layouts)
    faults: Optional[FaultPlan] = None
    reducer: Any = None                      # gridshard.zero.ZeroDataParallel (any ZeRO stage)
    optimizer: Any = None
    precision: Optional[Precision] = None
    checkpointer: Optional[Checkpointer] = None
    start_step: int = 0                      # completed steps (train.resume: the checkpoint's)
    data_position: Optional[list] = None     # the checkpoint's record-row positions (data.kind hf / chat)
    ignore_index: int = -100
    pipeline: Any = None                     # P > 1: the PipelineRunner
    tied: Any = None                         # P > 1: the TiedEmbeddingSync
    driver: Any = None                       # MicroBatchLoop or PipelineSchedule
    norm_pairs: list = field(default_factory=list)    # (reduced gradient tensor, layout), each counted once
    clip_tensors: list = field(default_factory=list)  # what clipping scales
    plan: Optional[BatchPlan] = None
    val_plan: Optional[BatchPlan] = None
    decay_steps: int = 0
    warmup: Any = None                       # train.compile: the first step's raised timeout (engine.warmup)
    moe: Any = None                          # a model with MoE blocks: its gridshard.moe.training.MoETraining

    def batch(self, step: int):
        """Step ``step``'s :class:`~gridshard.engine.step.StepBatch` of this rank (the training data plan)."""
        return StepBatch(step, *self.plan.step_batches(step))


def build_job(config=None, run_dir: Optional[str] = None, *, overrides=()) -> Job:
    """Compose this rank's part of the job described by ``config`` (YAML path, dict,
    :class:`~gridshard.config.TrainConfig`, :class:`ResolvedConfig` or None = the built-in
    default; ``overrides`` as ``key.sub=value``), in the module docstring's order. Collective:
    every rank of the job calls it. ``run_dir``: checkpoints and resume (rank 0's for all)."""
    job = _frame(config, overrides, run_dir)
    plain = _model_on_meta(job)
    plain = _stage_split(job, plain)
    _parallelize(job, plain)
    _recompute(job)
    _compile(job)
    _reducer(job)
    _optimizer(job)
    _checkpointer(job)
    _driver(job)
    before = rss_now() if job.device.type == "cpu" else 0
    _data(job)
    job.data_bytes = max(0, rss_now() - before) if job.device.type == "cpu" else 0
    job.warmup = start_warmup(job)             # train.compile: a longer collective timeout until compiled
    return job


# ---- before the model: the resolved config, the mesh and the job layout ------------------
def resolve_job_config(config, overrides=(), run_dir: Optional[str] = None) -> TrainConfig:
    """The config validated against this process group (joined here when it is not yet; with
    ``run_dir``, where NCCL's flight recorder dumps):
    a :class:`ResolvedConfig` as it is (its world size must be this group's), anything else
    through :func:`gridshard.config.resolve_config`."""
    resolved = isinstance(config, ResolvedConfig)
    if not dist.is_initialized():
        loaded = config.config if resolved else load_config(config, overrides)
        init_distributed(loaded.parallel.backend, timeout_s=loaded.train.collective_timeout_s, run_dir=run_dir)
    if resolved:
        here = (dist.get_world_size(), rank_device().type == "cuda", list(overrides))
        if here != (config.world_size, config.cuda_available, []):
            raise ConfigError(f"a config resolved for {config.world_size} process(es) (CUDA available: "
                              f"{config.cuda_available}) was handed to {here[0]} (CUDA available: {here[1]}; "
                              f"overrides {here[2]}). Fix: pass the config itself, resolved here.")
        return config.config
    cfg = resolve_config(config, overrides, world_size=dist.get_world_size(),
                         cuda_available=rank_device().type == "cuda")
    if cfg.parallel.backend not in ("auto", dist.get_backend()):
        raise ConfigError(f"parallel.backend={cfg.parallel.backend} but this process group runs "
                          f"{dist.get_backend()}. Fix: parallel.backend: auto (the group's backend decides) or "
                          f"{dist.get_backend()}.")
    return cfg


def _frame(config, overrides, run_dir) -> Job:
    """The resolved config, rank 0's run directory, the resume source (checked before anything
    is built), the job's ledger and mesh, and the job layout."""
    cfg = resolve_job_config(config, overrides, run_dir)
    device, rank = rank_device(), dist.get_rank()
    # rank 0's run directory for all (e.g. timestamped defaults under torchrun); not under the fake backend of
    # gridshard emulate, whose collectives return nothing (planner.emulate)
    if dist.get_world_size() > 1 and dist.get_backend() != "fake":
        box = [run_dir]
        dist.broadcast_object_list(box, 0)
        run_dir = box[0]
    resume_from, changes = resume_folder(cfg.train.resume, run_dir), []
    if resume_from is not None:
        from ..checkpoint.files import read_meta

        saved = read_meta(resume_from)
        changes = check_compatible(saved["config"], cfg.resolved(), describe(resume_from),
                                   start_step=saved.get("step"))
    p, model_cfg = cfg.parallel, cfg.model.resolve()
    math_modes = apply_math_modes(cfg.train.precision, cfg.train.tf32, cfg.train.deterministic, device)
    ranges = Ranges()                          # profiler ranges, on while a trace records (engine.profiling)
    ledger = CommLedger(ranges=ranges)         # this job's collectives only (its mesh records here)
    mesh = build_mesh(p.data, p.pipeline, p.tensor, p.tensor_mode, ledger=ledger, context=p.context,
                      depth=p.tensor_depth, expert=p.expert)
    return Job(cfg=cfg, layout=JobLayout.from_config(cfg, model_cfg), model_cfg=model_cfg, device=device,
               rank=rank, run_dir=run_dir, resume_from=resume_from, layout_changes=changes, ledger=ledger, ranges=ranges,
               mesh=mesh, mem_baseline=rss_now() if device.type == "cpu" else 0, math_modes=math_modes,
               ignore_index=-100 if cfg.data.ignore_token is None else cfg.data.ignore_token,
               decay_steps=cfg.train.decay_steps or cfg.train.steps)


# ---- the composition (COMPOSITION_ORDER) ------------------------------------------------
def _model_on_meta(job: Job):
    """1. The plain single-device model, every parameter on the meta device."""
    job.composed.append("model on meta")
    if job.cfg.model.hf_config is not None:
        from ..models.hf import build_hf_causal_lm

        return build_hf_causal_lm(job.cfg.model.hf_config, device="meta")
    family = VisionTransformer if job.cfg.model.kind == "vit" else Transformer
    with torch.device("meta"):
        return family(job.model_cfg)


def _stage_split(job: Job, plain):
    """2. P > 1: this rank's stages only, under single-device names."""
    job.composed.append("stage split")
    if job.cfg.parallel.pipeline > 1:
        return pipeline_rank_model(plain, job.mesh, job.layout.split)
    return plain


def _parallelize(job: Job, plain) -> None:
    """3. :func:`gridshard.parallelize`: this rank's blocks, then ``model.init_from``'s values."""
    job.composed.append("parallelize")
    p, t = job.cfg.parallel, job.cfg.train
    # values are a function of (seed, name, global index): the same global model at every layout
    job.model = parallelize(plain, job.mesh, sequence_parallel=p.sequence_parallel, seed=t.seed,
                            device=job.device, summa_overlap=p.summa_overlap,
                            # zero bubble defers the weight pass: nothing to overlap dx's collective with
                            overlap_input_grad=p.overlap_input_grad and p.pipeline_schedule != "zero_bubble",
                            context_mode=job.layout.context_mode, expert_dispatch=p.expert_dispatch)
    job.context = context_of(job.model)
    named = [(n, q) for n, q in job.model.named_parameters() if q.requires_grad]
    job.params = [q for _, q in named]
    job.param_specs = [job.context.layouts[n] for n, _ in named]     # clipping reads the layouts
    job.faults = FaultPlan.from_env()
    job.moe = MoETraining.of(job.model, job.model_cfg, job.mesh, job.cfg.train, job.device)
    if job.resume_from is None and job.cfg.model.init_from is not None:
        _init_from(job, job.cfg.model.init_from)     # into the whole blocks, before ZeRO shards them


def _init_from(job: Job, path: str) -> None:
    """``model.init_from``: the weights only, into the whole blocks of this rank — before ZeRO
    shards them and before the optimizer exists, so a gridshard checkpoint is read through the
    verifying reader's model-only path (no optimizer, generator or step) of a checkpointer of
    its own (its gloo group is closed after)."""
    from ..checkpoint.hf_io import is_gridshard_checkpoint, load_hf_blocks

    if not is_gridshard_checkpoint(path):
        load_hf_blocks(job.model, path, hf_names=job.cfg.model.hf_config is not None)
        return
    reader = Checkpointer(None, faults=job.faults)
    try:
        reader.load_weights(path, job.model)
    finally:
        reader.close()


def _recompute(job: Job) -> None:
    """4. ``train.recompute`` on every decoder layer."""
    job.composed.append("recompute")
    apply_recompute(job.model, job.cfg.train.recompute)


def _compile(job: Job) -> None:
    """5. ``train.compile``: ``torch.compile`` of every decoder layer's forward."""
    job.composed.append("compile")
    if job.cfg.train.compile:
        apply_compile(job.model)


def _reducer(job: Job) -> None:
    """6. The data-parallel reduction of ``train.zero``'s stage (:mod:`gridshard.zero.reducer`):
    what the optimizer steps, what the norm counts and what a checkpoint holds all come from it."""
    job.composed.append("reducer")
    p, t = job.cfg.parallel, job.cfg.train
    # bf16: parameters stored in bf16 from here on, fp32 masters in the reducer (the one cast)
    # parameters are replicated over data and context ranks (and 2.5D depth layers): reduced over all of
    # them (mesh.data_context, which is mesh.data itself at C = d = 1; the only depth sum in training)
    # reductions inside the backward where reduces_in_backward says (ZeRO-2/3: sharded accumulation,
    # with pipeline stages too, but not zero_bubble); a cross-stage tied embedding copy's root unit
    # waits for TiedEmbeddingSync's sum (sync())
    overlap = reduces_in_backward(t.zero, job.mesh.data_context.size, p.pipeline, p.pipeline_schedule,
                                  t.overlap_grad_reduce)
    tied_copy = holds_tied_copy(job.model, p.pipeline, bool(getattr(job.model_cfg, "tie_embeddings", False)))
    job.reducer = build_reducer(job.model, job.mesh.data_context, t.zero, int(t.bucket_mb * 2**20),
                                overlap=overlap, defer_root=tied_copy,
                                host_pages=_host_pages(job),
                                param_dtype=param_dtype(t.precision),
                                grad_reduce_dtype=DTYPES[t.grad_reduce_dtype],
                                expert_axes=(job.mesh.expert, job.mesh.expert_data) if p.expert > 1 else None)


def _host_pages(job: Job) -> bool:
    """``train.zero3_host_memory`` resolved (:func:`gridshard.zero.pages.host_pages_in_effect`: unset →
    pages for ZeRO-3 on a Linux CPU, heap elsewhere, silently); an explicit ``pages`` where it does not
    act (CUDA, not Linux) gives one warning on rank 0 (:func:`gridshard.zero.pages.host_pages_note`)."""
    from ..zero.pages import host_pages_in_effect, host_pages_note

    setting = job.cfg.train.zero3_host_memory
    on = host_pages_in_effect(setting, job.cfg.train.zero, job.device)
    if setting == "pages" and not on and job.rank == 0:
        import warnings

        warnings.warn(host_pages_note(job.device), RuntimeWarning, stacklevel=2)
    return on


def _optimizer(job: Job) -> None:
    """7. AdamW over the reducer's stepped tensors (host memory with ``train.offload=optimizer``
    on CUDA) and the precision policy (autocast, fp16 loss scaling)."""
    job.composed.append("optimizer")
    t = job.cfg.train
    offload = t.offload == "optimizer" and job.device.type == "cuda"
    if t.offload == "optimizer" and not offload:
        from ..zero import warn_offload_on_cpu

        warn_offload_on_cpu(job.device, job.rank)
    job.optimizer = build_optimizer(job.model, t.lr, t.weight_decay, (t.beta1, t.beta2), t.adam_eps,
                                    tensors=job.reducer.optimizer_tensors(), offload=offload)
    job.precision = Precision(t.precision, job.device)


def _checkpointer(job: Job) -> None:
    """8. The checkpointer (when there is a run directory or a resume source) and
    ``train.resume``: model, optimizer, reducer chunks, loss scale, step."""
    job.composed.append("checkpointer")
    t = job.cfg.train
    if job.run_dir is not None or job.resume_from is not None:
        job.checkpointer = Checkpointer(job.run_dir, t.keep_checkpoints, job.faults)
    if job.resume_from is not None:
        _resume(job, job.resume_from)


def _resume(job: Job, folder: str) -> None:
    meta = job.checkpointer.load(folder, job.model, job.optimizer, reducer=job.reducer)
    if hasattr(job.optimizer, "reload_from_device"):
        job.optimizer.reload_from_device()
    job.start_step = int(meta["step"])
    job.data_position = meta.get("data_position")      # record sources' row positions (data.record_rows)
    G = job.cfg.train.global_batch
    if int(meta["samples"]) != job.start_step * G:
        raise CheckpointError(f"checkpoint {describe(folder)}: data position {meta['samples']} samples is not "
                              f"step × global_batch = {job.start_step}×{G}. Fix: resume with the global batch "
                              f"it was written with.")
    if job.precision.scaler is not None and meta.get("loss_scaler"):
        job.precision.scaler.load_state_dict(meta["loss_scaler"])
    if job.rank == 0:
        changed = "; changes: " + ", ".join(job.layout_changes) if job.layout_changes else ""
        print(f"gridshard: resumed from {folder} at step {job.start_step}{changed}", file=sys.stderr)


# ---- after the composition: the micro-batch driver, the norm's tensors, the data ---------
def _driver(job: Job) -> None:
    """The micro-batch driver (P = 1: one after the other; P > 1: the pipeline schedule over
    this rank's stages, with the tied embedding's gradient sync) and the gradient norm's
    (tensor, layout) pairs: each reduced tensor with its parameter's layout (ZeRO: element ranges, once
    over data ranks), a tied weight's copy on the last stage left out."""
    p, t = job.cfg.parallel, job.cfg.train
    if p.pipeline > 1:
        from ..pipeline import PipelineRunner, TiedEmbeddingSync

        job.tied = TiedEmbeddingSync(job.model, job.mesh, job.model_cfg.tie_embeddings)
        job.pipeline = PipelineRunner(
            job.model, job.mesh, schedule=p.pipeline_schedule, split=job.layout.split, micro_batch=t.micro_batch,
            n_microbatches=job.layout.micro_batches, seq_len=job.cfg.data.seq_len // p.context,   # a rank's tokens
            loss=lambda logits, targets: job.context.loss(logits, targets, job.ignore_index, reduction="sum"),
            precision=job.precision, device=job.device)
        job.driver = PipelineSchedule(job.pipeline, job.tied, job.device)
        counted = {id(q) for q in job.tied.counted(job.params)}
    else:
        job.driver = MicroBatchLoop(job.model, job.context, job.precision, job.reducer, job.ignore_index, job.device,
                                    job.ranges)
        counted = {id(q) for q in job.params}
    spec_of = {id(q): s for q, s in zip(job.params, job.param_specs)}
    norm_tensors = job.reducer.norm_tensors()
    job.norm_pairs = [(x, spec_of[id(q)]) for x, q in norm_tensors if id(q) in counted]
    job.clip_tensors = [x for x, _ in norm_tensors]


def _data(job: Job) -> None:
    """The batch plans: the training data's (and the validation data's, ``stream=1``)."""
    cfg, t, d = job.cfg, job.cfg.train, job.cfg.data
    if d.kind in ("digits", "images"):                 # labelled images (model.kind: vit)
        from ..data.images import image_plans

        job.plan, job.val_plan = image_plans(cfg, cfg.parallel.data, job.mesh.data.rank)
        return
    if d.kind in ("hf", "chat"):                       # record sources: a stream per global row
        job.plan, job.val_plan = _record_plan(job), None
        return
    tokens, val_tokens = load_split(d)
    rank, D, V = job.mesh.data.rank, cfg.parallel.data, job.model_cfg.vocab_size
    packer, val_packer = split_packers(d, tokens, val_tokens)
    job.plan = BatchPlan(tokens, d.seq_len, t.global_batch, t.micro_batch, D, rank, t.seed, V, d.ignore_token,
                         packer=packer)
    job.val_plan = None if val_tokens is None else BatchPlan(
        val_tokens, d.seq_len, t.global_batch, t.micro_batch, D, rank, t.seed, V, d.ignore_token, stream=1,
        packer=val_packer)


def _record_plan(job: Job):
    """``data.kind`` hf / chat: the :class:`gridshard.data.record_rows.RecordRows` of this data rank,
    at the checkpoint's data position when resuming; N summed over the data axis (ledger paused)."""
    import functools

    from ..comm import collectives as C
    from ..data.record_rows import RecordRows
    from ..data.records import RecordSource, record_tokens, run_tokenizer_of

    cfg, t, d = job.cfg, job.cfg.train, job.cfg.data
    tokenizer = run_tokenizer_of(d)
    eod = d.eod_token if d.eod_token is not None else tokenizer.eos_id

    def sum_over_data(x: torch.Tensor) -> torch.Tensor:
        with job.ledger.paused():
            return C.all_reduce(x.to(job.device), job.mesh.data, inplace=True).cpu()

    plan = RecordRows(RecordSource(d.path, d.hf_split, d.hf_streaming),
                      functools.partial(record_tokens, kind=d.kind, field=d.hf_text_field, tokenizer=tokenizer, eod=eod),
                      d.seq_len, t.global_batch, t.micro_batch, cfg.parallel.data, job.mesh.data.rank, d.packing,
                      d.document_mask, pad=0 if eod is None else eod, vocab_size=job.model_cfg.vocab_size,
                      sum_over_data=sum_over_data, ignore_token=d.ignore_token)
    if job.data_position is not None:
        plan.load_position(job.data_position, job.start_step)
    elif job.start_step:
        raise CheckpointError(f"checkpoint {describe(job.resume_from)} holds no data position, and data.kind="
                              f"{d.kind} needs one to continue its record streams. Fix: resume a checkpoint written "
                              f"by a data.kind={d.kind} run, or start again.")
    return plan
