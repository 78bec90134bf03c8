"""Cross-field rules of a config against the world size, checked before any process group.

Order of checks (the first failure is raised as one :class:`ConfigError`):

1. positive sizes;
2. layout: D·P·C·T == world size, T == 1 for ``none``, T = q² for ``2d``, T = q²·d (q ≥ 2) for
   ``2.5d`` with ``tensor_depth`` d, T = q³ (q ≥ 2) for ``3d`` (:func:`gridshard.mesh.validate_layout`),
   the micro-batch rules of 2.5D (``depth_rules``, :func:`_shapes`); sequence parallelism only in
   ``1d`` with T > 1;
   context parallelism (C > 1): seq_len a multiple of 2·C (and of C·T under sequence
   parallelism), all_to_all with C dividing the local heads, and only the compositions built
   (:func:`_context`);
3. batch: global_batch % (micro_batch·D) == 0 (the accumulation count is
   global_batch / (micro_batch·D)); pipeline: every stage ≥ 1 layer, enough micro-batches
   for the schedule, virtual stages only with interleaved 1F1B, gridshard's model only;
4. model shapes for the mode (:func:`gridshard.nn.shape_rules.model_shape_rules`),
   seq_len ≤ max_seq_len;
5. data: path present and readable, enough tokens in the training part and in the
   validation part (if any; ``val_fraction`` in [0, 1), not with ``val_path``), byte corpora
   need vocab ≥ 256, ignore_token (if set) a token id in [0, vocab_size) (a prepared
   folder's vocabulary is applied when loading, :func:`gridshard.config.load.apply_prepared`);
   packing: document masks need packing concat/first_fit and gridshard's Llama, packing needs
   document boundaries (``eod_token``, or a prepared folder's records), ``eod_token`` a token id;
6. optimizer: lr ≥ 0, min_lr ≤ lr, intervals ≥ 1;
   precision fp16 needs CUDA; checkpoint settings (keep ≥ 0, a resume path that exists);
   eval_interval ≥ 0, eval_batches ≥ 1.

Token ids over the whole file (:func:`gridshard.data.prepare.check_token_ids`) and an
explicitly set ``warmup_steps`` ≤ ``steps`` are checked once by the CLI before launch
(:func:`check_before_launch`), not here: this runs again on every rank, which gets the
config with every field spelled out.
"""
from __future__ import annotations

import importlib.util
import os
from operator import attrgetter

from ..errors import ConfigError, LayoutError
from ..job_layout import ContextMode, StageSplit, TensorMode, check_context_sequence, micro_batches_per_step
from ..mesh import validate_layout
from ..nn.shape_rules import model_shape_rules
from .moe_rules import check_moe
from .rule_rows import fail as _fail, first_broken as _first_broken
from .schema import TrainConfig

# where each shape-rule name lives in the config
_SHAPE_FIELDS = {"hidden": "model.hidden", "heads": "model.heads", "ffn_hidden": "model.ffn_hidden",
                 "kv_heads": "model.kv_heads",
                 "head_dim": "model.hidden/model.heads", "seq_len": "data.seq_len",
                 "micro_batch": "train.micro_batch"}


_AT_LEAST_ONE = ("parallel.data", "parallel.tensor", "parallel.pipeline", "train.global_batch", "train.micro_batch",
                 "train.steps", "train.log_interval", "data.seq_len", "data.max_bytes")
_AT_LEAST_ZERO = ("train.warmup_steps", "train.save_interval", "train.weight_decay", "train.grad_clip",
                  "train.gc_interval")
_LLAMA_SIZES = ("vocab_size", "hidden", "layers", "heads", "ffn_hidden", "max_seq_len")
_VIT_SIZES = ("image_size", "patch_size", "channels", "num_classes", "hidden", "layers", "heads", "ffn_hidden")


def _positive(cfg: TrainConfig):
    m = cfg.model.resolve()
    sizes = _VIT_SIZES if cfg.model.kind == "vit" else _LLAMA_SIZES
    ones = [(f, attrgetter(f)(cfg)) for f in _AT_LEAST_ONE]
    zeros = [(f, attrgetter(f)(cfg)) for f in _AT_LEAST_ZERO]
    _first_broken([(f, v, v < 1, "it must be an integer >= 1", f"set {f} to a positive integer")
                   for f, v in ones + [(f"model.{k}", getattr(m, k)) for k in sizes]]
                  + [(f, v, v < 0, "it must be >= 0", f"set {f} to 0 or more") for f, v in zeros]
                  + [(f"model.{k}", getattr(m, k), getattr(m, k) <= 0, "it must be > 0", "use e.g. 0.02 / 1e-5")
                     for k in ("init_std", "norm_eps")])


def _layout(cfg: TrainConfig, world_size: int):
    p = cfg.parallel
    try:
        validate_layout(world_size, p.data, p.pipeline, p.tensor, p.tensor_mode, p.context, p.tensor_depth, p.expert)
    except LayoutError as e:
        raise ConfigError(f"parallel section: {e} (world size {world_size} = --nproc or WORLD_SIZE)") from None
    if p.sequence_parallel and not TensorMode.parse(p.tensor_mode).sequence_parallel_in_effect(True, p.tensor):
        _fail("parallel.sequence_parallel", True,
              f"sequence parallelism splits the 1d tensor group's activations, but tensor_mode={p.tensor_mode!r} "
              f"and tensor={p.tensor}", "set parallel.sequence_parallel=false, or tensor_mode=1d with tensor>1")


def _context(cfg: TrainConfig):
    """Context parallelism (C > 1): only the compositions built (gridshard's or Hugging Face's Llama
    without a sliding window, any tensor mode, any pipeline schedule — zero_bubble's deferred weight
    pass starts at the projections and never re-runs the attention's backward —, compiled or not),
    the sequence split (:func:`gridshard.job_layout.check_context_sequence`) and all_to_all's heads
    (:meth:`gridshard.job_layout.ContextMode.check_heads`)."""
    p = cfg.parallel
    if p.context == 1:
        return
    sliding = None
    if cfg.model.hf_config is not None:
        from ..models.hf import read_hf_json
        from ..models.hf_stages import sliding_window_in_effect

        sliding = sliding_window_in_effect(read_hf_json(cfg.model.hf_config))
    _first_broken((field, value, refused, f"parallel.context={p.context} splits every sequence over {p.context} "
                   f"ranks, but {why} (supported: gridshard's or a Hugging Face Llama with tensor_mode none, 1d (± "
                   f"sequence_parallel), 2d, 2.5d or 3d, any data parallelism and ZeRO stage, any pipeline schedule, "
                   f"compiled or not)", "set parallel.context=1, or change this field")
                  for field, value, refused, why in (
        ("model.hf_config", cfg.model.hf_config, sliding is not None, f"its layers attend through a sliding window "
         f"({sliding} tokens), and the context attention is plain causal"),
        ("model.kind", cfg.model.kind, cfg.model.kind != "llama", "it splits a language model's token sequence")))
    mode, T = TensorMode.parse(p.tensor_mode).layer_layout(p.tensor, p.tensor_depth)    # 2.5d: 2D on q²
    m = cfg.model.resolve()
    try:
        check_context_sequence(cfg.data.seq_len, p.context, T, mode.sequence_parallel_in_effect(p.sequence_parallel, T))
        ContextMode.parse(p.context_mode).check_heads(m.heads // mode.head_split(T),
                                                      mode.local_kv_heads(m.kv_heads, T), p.context)
    except LayoutError as e:
        raise ConfigError(f"parallel section: {e}") from None


def _batch(cfg: TrainConfig):
    t, d = cfg.train, cfg.parallel.data
    if t.global_batch % (t.micro_batch * d):
        per_step = t.micro_batch * d
        lo = max(per_step, (t.global_batch // per_step) * per_step)
        _fail("train.global_batch", t.global_batch,
              f"it must be a multiple of train.micro_batch × parallel.data = {t.micro_batch}×{d} = {per_step} "
              f"(each optimizer step accumulates whole micro-batches on every data rank)",
              f"use train.global_batch={lo} or {lo + per_step}, or change train.micro_batch")


def _pipeline(cfg: TrainConfig):
    """Pipeline rules: stages hold ≥ 1 layer, the schedule gets the micro-batches it needs."""
    p, t = cfg.parallel, cfg.train
    if p.virtual_stages < 1:
        _fail("parallel.virtual_stages", p.virtual_stages, "it must be >= 1", "use 1 (or 2+ with interleaved_1f1b)")
    if p.pipeline == 1:
        return _first_broken((f, v, broken, "it describes pipeline stages but parallel.pipeline=1",
                              "remove it, or set parallel.pipeline > 1") for f, v, broken in (
            ("parallel.virtual_stages", p.virtual_stages, p.virtual_stages != 1),
            ("parallel.stage_layers", p.stage_layers, p.stage_layers is not None)))
    StageSplit.of(cfg.model.resolve().layers, p.pipeline, p.virtual_stages, p.stage_layers)  # raises ConfigError
    if cfg.model.hf_config is not None:                # the stages run Llama's causal forward (models.hf_stages)
        from ..models.hf import read_hf_json
        from ..models.hf_stages import check_stageable

        check_stageable(read_hf_json(cfg.model.hf_config))
    micro = micro_batches_per_step(t.global_batch, t.micro_batch, p.data)
    schedule, interleaved = p.pipeline_schedule, p.pipeline_schedule in ("interleaved_1f1b", "zero_bubble")
    _first_broken([
        ("parallel.virtual_stages", p.virtual_stages, schedule in ("gpipe", "1f1b") and p.virtual_stages != 1,
         f"pipeline_schedule={schedule} runs one stage per rank",
         "set virtual_stages=1, or pipeline_schedule=interleaved_1f1b"),
        ("parallel.virtual_stages", p.virtual_stages, interleaved and p.virtual_stages < 2,
         f"{schedule} needs at least 2 stages per rank",
         "set parallel.virtual_stages=2 (or more), or pipeline_schedule=1f1b"),
        ("train.global_batch", t.global_batch, schedule == "1f1b" and micro < p.pipeline,
         f"1F1B needs at least P={p.pipeline} micro-batches per step, but global_batch / (micro_batch × data) = "
         f"{t.global_batch}/({t.micro_batch}×{p.data}) = {micro}",
         f"use train.global_batch >= {p.pipeline * t.micro_batch * p.data}, a smaller micro_batch, or "
         f"pipeline_schedule=gpipe"),
        ("train.global_batch", t.global_batch, interleaved and (micro < p.pipeline or micro % p.pipeline),
         f"{schedule} needs a multiple of P={p.pipeline} micro-batches per step, but global_batch / (micro_batch × "
         f"data) = {micro}", f"use train.global_batch = k × {p.pipeline * t.micro_batch * p.data}")])


def _shapes(cfg: TrainConfig):
    """The model's shape rules for the mode; at 2.5D those of 2D on one depth layer's q² ranks, whose
    micro-batch is m/d rows (so m must be a multiple of d·q). What a ViT needs beyond them: under
    sequence parallelism whole blocks of its 1 + (image/patch)² tokens (the shared rule, said in the
    ViT's terms), and the MLP width in the blocks the mode stores a bias in (the scheme's
    ``bias_rules``: 2D q², 3D q³)."""
    p, m = cfg.parallel, cfg.model.resolve()
    job_mode = TensorMode.parse(p.tensor_mode)
    mode, T = job_mode.layer_layout(p.tensor, p.tensor_depth)
    d, micro = p.tensor_depth, cfg.train.micro_batch
    _first_broken(("train.micro_batch", micro, not r.holds, r.why, r.fix)
                  for r in job_mode.depth_rules(p.tensor, d, micro))
    rules = model_shape_rules(mode, T, p.sequence_parallel, micro // d,
                              cfg.data.seq_len, m.hidden, m.heads, m.ffn_hidden, m.kv_heads)
    if cfg.model.kind == "vit":      # no rotary embeddings (any head_dim); its token count: below
        rules = [r for r in rules if r.what not in ("head_dim", "seq_len")]
    for rule in rules:
        if not rule.holds:
            raise ConfigError(f"{_SHAPE_FIELDS.get(rule.what, rule.what)} ({p.tensor_mode} mode, tensor={p.tensor}): "
                              f"{rule.message()}")
    if cfg.model.kind == "vit":
        sp = mode.sequence_parallel_in_effect(p.sequence_parallel, T)
        return _first_broken([
            ("model.image_size/model.patch_size", (m.image_size, m.patch_size), sp and m.seq_len % p.tensor,
             f"sequence parallelism splits the ViT's 1 + (image_size/patch_size)² = {m.seq_len} tokens into "
             f"tensor={p.tensor} blocks", "choose sizes whose token count is a multiple of the tensor size "
             "(e.g. image 12, patch 4: 10 tokens for tensor=2), or parallel.sequence_parallel=false")]
            + [("model.ffn_hidden", m.ffn_hidden, not r.holds, r.why, r.fix) for r in mode.bias_rules(T, m.ffn_hidden)]
            + [("data.kind", cfg.data.kind, cfg.data.kind not in _IMAGE_DATA, "model.kind=vit learns from "
                "labelled images", "use digits or images")])
    if cfg.data.seq_len > m.max_seq_len:
        _fail("data.seq_len", cfg.data.seq_len, f"it exceeds model.max_seq_len={m.max_seq_len} (the RoPE table length)",
              f"set data.seq_len <= {m.max_seq_len} or model.max_seq_len >= {cfg.data.seq_len}")


_IMAGE_DATA = ("digits", "images")


def _image_data(cfg: TrainConfig) -> None:
    """digits / images: a ViT reads them, with a validation share in [0, 1); images need a folder
    whose every file is then checked (the file checks last)."""
    d = cfg.data
    _first_broken([
        ("data.kind", d.kind, cfg.model.kind != "vit", "labelled images train a Vision Transformer",
         "set model.kind: vit"),
        ("data.packing", d.packing, d.packing != "none" or d.document_mask,
         "images are whole examples, not documents to pack", "use data.packing=none, data.document_mask=false"),
        ("data.path", d.path, d.kind == "images" and not d.path,
         "data.kind=images needs a folder with one subfolder of images per class", "set data.path"),
        ("data.path", d.path, d.kind == "digits" and d.path is not None,
         "data.kind=digits is scikit-learn's bundled set and takes no path",
         "remove data.path, or use data.kind=images"),
        ("data.val_fraction", d.val_fraction, d.val_fraction is not None and not 0 <= d.val_fraction < 1,
         "it is the share of the images held out for validation, in [0, 1)", "use e.g. 0.2")])
    if d.kind == "images":
        from ..data.images import verify_image_folder

        verify_image_folder(d.path)                    # non-empty class folders, every file an image Pillow verifies


def _data(cfg: TrainConfig):
    from ..data.sources import split_sizes  # pure file inspection, no process group

    d, m = cfg.data, cfg.model.resolve()
    if d.kind in _IMAGE_DATA:
        return _image_data(cfg)
    if d.kind in _RECORD_DATA:
        return _record_data(cfg)
    _first_broken([
        ("data.path", d.path, d.kind == "stdlib" and d.path is not None,
         "data.kind=stdlib reads Python's own library and takes no path",
         "remove data.path, or set data.kind=text / tokens"),
        ("data.path", d.path, d.kind in ("text", "tokens", "prepared") and not d.path,
         f"data.kind={d.kind} needs a path",
         "set data.path to a text file/folder (text), a token file (tokens) or a prepare-data folder (prepared)"),
        ("data.val_fraction", d.val_fraction, d.val_fraction is not None and not 0 <= d.val_fraction < 1,
         "it is the share of the data held out for validation, in [0, 1)", "use e.g. 0.01, or 0 for no validation"),
        ("data.val_fraction", d.val_fraction, d.val_path is not None and d.val_fraction,
         "data.val_path already gives the validation data", "remove one of data.val_fraction and data.val_path"),
        ("data.val_path", d.val_path, d.val_path is not None and d.kind == "stdlib", "data.kind=stdlib takes no paths",
         "use data.val_fraction instead"),
        ("model.vocab_size", m.vocab_size, d.kind in ("stdlib", "text") and m.vocab_size < 256,
         f"data.kind={d.kind} yields bytes 0..255", "set model.vocab_size >= 256 (the tiny preset uses 256)"),
        ("data.ignore_token", d.ignore_token, d.ignore_token is not None and not 0 <= d.ignore_token < m.vocab_size,
         f"it must be a token id in [0, model.vocab_size={m.vocab_size}) (it is also fed to the model as an input "
         f"token)", "set it to the padding id of the tokenizer, or null to use every target")])
    _packing(cfg)
    n_tokens, n_val = split_sizes(d)
    _first_broken([
        ("data.path" if d.path else "data.kind", d.path or d.kind, n_tokens < d.seq_len + 1,
         f"the training data holds {n_tokens} tokens but one sequence needs data.seq_len+1 = {d.seq_len + 1}",
         "use more data, a smaller data.val_fraction or a shorter data.seq_len"),
        ("data.val_path" if d.val_path else "data.val_fraction", d.val_path or d.val_fraction,
         0 < n_val < d.seq_len + 1,
         f"the validation data holds {n_val} tokens but one sequence needs data.seq_len+1 = {d.seq_len + 1}",
         "hold out more data (a larger val_fraction) or set data.val_fraction=0")])


_RECORD_DATA = ("hf", "chat")


def _record_data(cfg: TrainConfig) -> None:
    """hf / chat (:mod:`gridshard.data.records`): a path, no validation part yet, a vocabulary that
    holds the tokenizer's, the packing rules, then the dataset itself (opened, its first record read)."""
    from ..data.records import check_records, run_tokenizer_of

    d, m = cfg.data, cfg.model.resolve()
    _first_broken([
        ("data.path", d.path, not d.path, f"data.kind={d.kind} reads a local dataset",
         "set data.path to a saved dataset folder, a folder of data files or one data file"),
        ("data.val_fraction" if d.val_fraction else "data.val_path", d.val_fraction or d.val_path,
         bool(d.val_fraction) or d.val_path is not None,
         f"data.kind={d.kind} holds no validation part yet", "remove data.val_fraction / data.val_path")])
    vocab = run_tokenizer_of(d).vocab_size
    _first_broken([
        ("model.vocab_size", m.vocab_size, m.vocab_size < vocab,
         f"data.tokenizer={d.tokenizer!r} has {vocab} ids", f"set model.vocab_size >= {vocab}")])
    _packing(cfg)
    check_records(d)


def _packing(cfg: TrainConfig):
    """data.packing / document_mask / eod_token (:mod:`gridshard.data.packing`)."""
    d, m = cfg.data, cfg.model.resolve()
    _first_broken([
        ("data.document_mask", True, d.document_mask and d.packing == "none",
         "document masks need to know where documents start, and data.packing=none does not",
         "set data.packing=concat (the same windows) or first_fit"),
        ("data.document_mask", True, d.document_mask and cfg.model.hf_config is not None,
         "Hugging Face models (model.hf_config) attend with their own attention code, which gridshard does not "
         "give document masks", "use gridshard's Llama (model.kind=llama), or data.document_mask=false"),
        ("data.eod_token", d.eod_token, d.eod_token is not None and not 0 <= d.eod_token < m.vocab_size,
         f"it must be a token id in [0, model.vocab_size={m.vocab_size})", "use the tokenizer's end-of-text id"),
        ("data.eod_token", d.eod_token, d.packing != "none" and d.eod_token is None
         and d.kind not in ("prepared",) + _RECORD_DATA,
         f"data.kind={d.kind} has no record boundaries, so data.packing={d.packing} needs the token that ends a "
         f"document", "set data.eod_token (e.g. 10, a newline, for stdlib/text bytes)")])


def _optim(cfg: TrainConfig, cuda_available: bool, world_size: int):
    t = cfg.train
    _first_broken([
        ("train.lr", t.lr, t.lr < 0, "a learning rate must be >= 0", "use a positive value such as 3e-4"),
        ("train.min_lr", t.min_lr, t.min_lr < 0 or t.min_lr > t.lr, f"it must lie in [0, train.lr={t.lr}]",
         f"set train.min_lr <= {t.lr}"),
        ("train.beta1/beta2", (t.beta1, t.beta2), not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1),
         "Adam betas lie in [0, 1)", "use 0.9 and 0.95"),
        ("train.eval_interval", t.eval_interval, t.eval_interval < 0,
         "it must be >= 0 (0: evaluate at the last step only)", "use e.g. 50"),
        ("train.eval_batches", t.eval_batches, t.eval_batches < 1, "an evaluation needs at least one batch",
         "use e.g. 4")])
    if "tensorboard" in t.log_to:
        if importlib.util.find_spec("tensorboard") is None:
            _fail("train.log_to", t.log_to, "tensorboard logging needs the `tensorboard` package, which is not "
                  "installed", "pip install -e .[tensorboard], or train.log_to=[jsonl]")
    _first_broken([
        ("train.decay_steps", t.decay_steps, t.decay_steps is not None and t.decay_steps < 1, "it must be >= 1",
         "remove it (defaults to train.steps)"),
        ("train.bucket_mb", t.bucket_mb, t.bucket_mb <= 0, "the all-reduce bucket size must be > 0", "use e.g. 25"),
        ("train.precision", "fp16", t.precision == "fp16" and not cuda_available,
         "fp16 with loss scaling runs on CUDA GPUs only, and none is visible",
         "use train.precision=bf16 (autocast, works on CPU) or fp32"),
        ("train.grad_reduce_dtype", "bf16", t.grad_reduce_dtype == "bf16" and t.precision != "bf16",
         f"train.precision={t.precision} keeps fp32 parameters and gradients; only bf16 storage "
         f"(train.precision=bf16) has bf16 gradients to reduce",
         "use train.grad_reduce_dtype=fp32, or train.precision=bf16"),
        ("train.recompute", "selective", t.recompute == "selective" and cfg.model.hf_config is not None,
         "selective recompute wraps the attention core and MLP activation of gridshard's own model; a Hugging Face "
         "model (model.hf_config) has its own attention and MLP code", "use train.recompute=full"),
        ("train.zero", 3, t.zero == 3 and cfg.parallel.pipeline > 1 and cfg.parallel.pipeline_schedule == "zero_bubble",
         "ZeRO-3 frees each layer's parameters after its backward, and the zero-bubble schedule runs a layer's "
         "weight gradients in a separate later pass", "use train.zero=2, or parallel.pipeline_schedule=1f1b"),
        ("train.zero3_host_memory", "pages", t.zero3_host_memory == "pages" and t.zero != 3,
         f"host pages hold ZeRO-3's chunks and layer buffers, and train.zero={t.zero} has none",
         "use train.zero=3, or train.zero3_host_memory=heap"),
        ("train.keep_checkpoints", t.keep_checkpoints, t.keep_checkpoints < 0,
         "it must be >= 0 (0 keeps every checkpoint)", "use e.g. 3"),
        ("train.profile_start", t.profile_start, t.profile_start is not None and not 1 <= t.profile_start <= t.steps,
         f"it is the first profiled step, between 1 and train.steps={t.steps}", "use e.g. 3, or null (off)"),
        ("train.profile_steps", t.profile_steps, t.profile_steps < 1, "it must be >= 1", "use e.g. 2"),
        ("train.profile_memory", True, t.profile_memory and not cuda_available,
         "it records the CUDA caching allocator's history, and no CUDA GPU is visible",
         "use train.profile_memory=false (CPU time and collectives: train.profile_start)"),
        ("train.profile_ranks", t.profile_ranks, isinstance(t.profile_ranks, list)
         and not all(0 <= r < world_size for r in t.profile_ranks),
         f"every entry must be a global rank of the {world_size}-process job", f"use ranks in 0..{world_size - 1}, "
         "or null (every rank)"),
        ("train.peak_flops", t.peak_flops, t.peak_flops is not None and not t.peak_flops > 0,
         "a device's peak FLOP/s must be > 0",
         "use the datasheet's dense figure, e.g. 989.4e12 for an H100 SXM in bf16, or null"),
        ("train.collective_timeout_s", t.collective_timeout_s, t.collective_timeout_s <= 0, "it must be > 0",
         "use e.g. 120"),
        ("train.compile_timeout_s", t.compile_timeout_s, t.compile_timeout_s <= 0, "it must be > 0", "use e.g. 900"),
        ("train.resume", t.resume, t.resume not in ("never", "auto") and not os.path.isdir(t.resume),
         "it must be never, auto or an existing checkpoint folder / run directory",
         "point it at RUN_DIR/checkpoints/step_N or RUN_DIR, or use auto")])


def validate_config(cfg: TrainConfig, world_size: int, cuda_available: bool = False,
                    check_data: bool = True) -> TrainConfig:
    """Raise :class:`ConfigError` on the first broken rule (module docstring); return ``cfg``.
    ``check_data=False`` skips the data rules (5.): the planner's per-layout check, whose data does
    not change with the layout (:func:`gridshard.planner.layouts.layout_problem`)."""
    _positive(cfg)
    _layout(cfg, world_size)
    _context(cfg)
    _batch(cfg)
    _pipeline(cfg)
    _shapes(cfg)
    check_moe(cfg)
    if check_data:
        _data(cfg)
    _optim(cfg, cuda_available, world_size)
    return cfg


def user_sets(source, overrides, section: str, key: str) -> bool:
    """Whether the user wrote ``section.key``: in an override or in the YAML file ``source``."""
    if any(o.partition("=")[0] == f"{section}.{key}" for o in overrides):
        return True
    if isinstance(source, str):
        from .load import read_yaml

        source = read_yaml(source)
    return isinstance(source, dict) and isinstance(source.get(section), dict) and key in source[section]


def check_before_launch(cfg: TrainConfig, warmup_set: bool = True) -> None:
    """The checks the CLI makes once before any worker starts: ``warmup_steps`` ≤ ``steps``
    when the user wrote the warm-up (``warmup_set``; the built-in defaults' 10 may exceed a short
    run, which then stays in warm-up), and every token id of a ``tokens``/``prepared`` source
    (and its validation source) below ``model.vocab_size`` — one vectorised pass over the file."""
    t = cfg.train
    if warmup_set and t.warmup_steps > t.steps:
        _fail("train.warmup_steps", t.warmup_steps, f"the warm-up must fit in the run: warmup_steps <= train.steps="
              f"{t.steps}", f"set train.warmup_steps <= {t.steps} (e.g. {max(1, t.steps // 10)})")
    d = cfg.data
    if d.kind in ("tokens", "prepared"):
        from ..data.prepare import check_token_ids
        from ..data.sources import load_tokens

        vocab = cfg.model.resolve().vocab_size
        for path in (d.path, d.val_path):
            if path is not None:
                check_token_ids(load_tokens(d.kind, path, d.token_dtype), vocab, f"data at {path!r}")
