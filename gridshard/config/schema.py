"""The typed schema of a training config: four sections, strict types, no unknown keys.

```yaml
parallel: {data: 2, tensor: 2, tensor_mode: 1d, sequence_parallel: false, pipeline: 1}
model:    {preset: tiny}                # or explicit fields, which override the preset's
data:     {kind: stdlib, seq_len: 128}  # stdlib | text (path) | tokens (path, token_dtype)
train:    {global_batch: 16, micro_batch: 4, lr: 3.0e-3, steps: 100, precision: fp32, ...}
```

Types are strict (``tensor: "2"`` or ``lr: true`` are errors, an int is accepted where
a float is asked). Cross-field and world-size rules live in
:mod:`gridshard.config.validate`; every failure becomes one :class:`ConfigError`.
See ``docs/config.md`` for every key.
"""
from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..models.llama import ModelConfig
from ..models.presets import preset_fields

_STRICT = ConfigDict(strict=True, extra="forbid")


class ParallelSection(BaseModel):
    """Device layout: D·P·C·T must equal the number of processes."""

    model_config = _STRICT
    data: int = Field(1, description="data-parallel replicas D")
    tensor: int = Field(1, description="tensor-parallel ranks T (q² in 2d, q²·d in 2.5d, q³ in 3d)")
    tensor_mode: str = Field(
        "none", description="a registered tensor scheme (gridshard/tensor/): none | 1d (Megatron) | 2d (SUMMA) | "
                            "2.5d (Tesseract: tensor_depth layers of a q×q grid; docs/tp2p5d.md) | 3d (a q×q×q "
                            "cube; docs/tp3d.md)")
    tensor_depth: int = Field(1, description="2.5d only: depth layers d (T = q²·d, q >= 2); 1 is 2D")
    sequence_parallel: bool = Field(False, description="1d only: split the residual stream along the sequence")
    context: int = Field(1, description="context-parallel ranks C: every sequence split into 2C chunks, rank i "
                                        "holding chunks i and 2C-1-i (docs/context.md)")
    context_mode: Literal["ring", "all_to_all"] = Field(
        "ring", description="how attention crosses the context ranks: ring (k/v blocks travel, any C) | "
                            "all_to_all (sequence traded for heads; C divides the local heads)")
    pipeline: int = Field(1, description="pipeline ranks P (layers split into P·virtual_stages stages)")
    expert: int = Field(1, description="expert-parallel ranks E (MoE models): each MoE layer's experts split over "
                                       "E ranks borrowed from data × context (E divides D·C; docs/moe.md)")
    expert_dispatch: Literal["all_to_all", "all_gather"] = Field(
        "all_to_all", description="how tokens reach their experts at E > 1: all_to_all (uneven splits, only what "
                                  "leaves the rank) | all_gather (every token to every expert rank, then a "
                                  "reduce-scatter; small E)")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b", description="gpipe | 1f1b | interleaved_1f1b | zero_bubble (the last two: virtual_stages ≥ 2)")
    virtual_stages: int = Field(1, description="stages per pipeline rank (interleaved_1f1b)")
    stage_layers: Optional[List[int]] = Field(None, description="decoder layers per stage (P·virtual_stages "
                                                                "counts); default: L/S per stage, leftovers to "
                                                                "the middle stages, then one to the first")
    summa_overlap: bool = Field(True, description="2d only: double-buffered async SUMMA broadcasts (false: "
                                                  "blocking, the benchmark baseline)")
    overlap_input_grad: bool = Field(True, description="1d only: each column layer's input-gradient all-reduce "
                                                       "(reduce-scatter under SP) runs while its weight gradient "
                                                       "is computed (false: after it); exact either way")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="collective backend and device: auto (nccl on cuda:LOCAL_RANK when CUDA is available, "
                            "else gloo on the CPU) | nccl (one GPU per rank) | gloo (the CPU, also on a GPU host); "
                            "gridshard/device.py")


VIT_ONLY_FIELDS = {"image_size", "patch_size", "channels", "num_classes"}
#: the Mixture-of-Experts fields besides model.experts (docs/moe.md): used only with experts > 0
MOE_MODEL_FIELDS = ("experts_per_token", "expert_ffn_hidden", "shared_experts", "moe_every", "router_score",
                    "router_normalize")
MOE_TRAIN_FIELDS = ("moe_aux_loss", "moe_bias_rate", "moe_capacity")


class ModelSection(BaseModel):
    """A preset name and/or explicit fields; explicit fields win over the preset's."""

    model_config = _STRICT
    kind: Literal["llama", "vit"] = Field("llama", description="llama (the decoder; presets apply) | vit (a "
                                                               "Vision Transformer classifier, docs/vision.md)")
    preset: Optional[str] = Field("tiny", description="tiny | 125m | 1.3b | 7b | 13b | 70b, or null (llama only)")
    vocab_size: Optional[int] = None
    hidden: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    max_seq_len: Optional[int] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    init_std: Optional[float] = None
    kv_heads: Optional[int] = Field(None, description="grouped-query attention kv heads (default = heads)")
    experts: Optional[int] = Field(None, description="Mixture-of-Experts: experts per MoE layer; 0 = dense "
                                                     "(default; docs/moe.md)")
    experts_per_token: Optional[int] = Field(None, description="MoE: experts each token is routed to, k (default 2)")
    expert_ffn_hidden: Optional[int] = Field(None, description="MoE: an expert's SwiGLU width (default ffn_hidden)")
    shared_experts: Optional[int] = Field(None, description="MoE: always-on shared experts (default 0)")
    moe_every: Optional[int] = Field(None, description="MoE: layer i is an MoE layer when (i+1) % moe_every == 0 "
                                                       "(default 1: every layer)")
    router_score: Optional[Literal["softmax", "sigmoid"]] = Field(None, description="MoE: router scores (default "
                                                                                    "softmax)")
    router_normalize: Optional[bool] = Field(None, description="MoE: divide the top-k weights by their sum "
                                                               "(default true)")
    hf_config: Optional[str] = Field(None, description="a Hugging Face config.json: train that architecture "
                                                       "(built from the config, no download; needs gridshard[hf])")
    init_from: Optional[str] = Field(None, description="start from these weights: a Hugging Face folder "
                                                       "(config.json + *.safetensors, e.g. `gridshard export` output) "
                                                       "or a gridshard checkpoint folder; any layout")
    image_size: Optional[int] = Field(None, description="vit: image side in pixels (images are square)")
    patch_size: Optional[int] = Field(None, description="vit: patch side in pixels; divides image_size")
    channels: Optional[int] = Field(None, description="vit: image channels (1 grey, 3 RGB)")
    num_classes: Optional[int] = Field(None, description="vit: classes of the classifier")

    def unmodelled(self) -> Optional[str]:
        """What the memory model and the planner do not price in this model, or None: a Hugging Face
        architecture. (A Mixture-of-Experts decoder is priced: its memory, its active FLOPs and its
        dispatch; the search enumerates the expert ranks, ``gridshard.planner``. A Vision Transformer
        is priced too: :mod:`gridshard.theory.memory.vision`.)"""
        if self.hf_config is not None:
            return "a Hugging Face architecture (model.hf_config; plan with the equivalent explicit model.* fields)"
        return None

    def explicit_fields(self) -> dict:
        return {k: v for k, v in self.model_dump().items()
                if k not in ("kind", "preset", "hf_config", "init_from") and v is not None}

    def resolve(self):
        """Preset fields (if any) updated with the explicit ones, or the dimensions of
        ``hf_config`` (a :class:`ModelConfig`); for ``kind: vit`` the explicit fields over the ViT
        defaults (a :class:`gridshard.models.vit.ViTConfig`). KeyError for an unknown preset;
        ConfigError for a field of the other kind."""
        if self.kind == "vit":
            from ..models.vit import vit_config

            return vit_config(self.explicit_fields())
        wrong = sorted(set(self.explicit_fields()) & VIT_ONLY_FIELDS)
        if wrong:
            from ..errors import ConfigError

            raise ConfigError(f"model.{wrong[0]} is a Vision Transformer field but model.kind=llama. Fix: set "
                              f"model.kind: vit, or remove {['model.' + w for w in wrong]}.")
        if self.hf_config is not None:
            from ..models.hf import model_config_of_hf_json

            return model_config_of_hf_json(self.hf_config)
        fields = preset_fields(self.preset) if self.preset is not None else {}
        fields.update(self.explicit_fields())
        return ModelConfig(**fields)


class DataSection(BaseModel):
    """Where tokens come from. ``stdlib`` and ``text`` are bytes (vocabulary 256); ``prepared``
    is a ``gridshard prepare-data`` folder (its vocabulary sets ``model.vocab_size``)."""

    model_config = _STRICT
    kind: Literal["stdlib", "text", "tokens", "prepared", "hf", "chat", "digits", "images"] = Field(
        "stdlib", description="stdlib | text | tokens | prepared (token data) | hf (a local Hugging Face dataset) | "
                              "chat (records with messages, loss on the assistant's tokens) | digits | images "
                              "(labelled images for model.kind=vit: scikit-learn's bundled digits, or a "
                              "class-per-subfolder folder)")
    path: Optional[str] = Field(None, description="text file/folder, token file (tokens), or a prepare-data folder "
                                                  "(prepared)")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="dtype of a tokens file (prepared: from "
                                                                           "its metadata)")
    val_fraction: Optional[float] = Field(None, description="the source's last val_fraction of tokens are held out "
                                                            "for validation; null: a prepared folder's own split, "
                                                            "else none")
    val_path: Optional[str] = Field(None, description="a separate validation source of the same kind as data.path")
    seq_len: int = Field(128, description="tokens per training sequence (vit: set from the model, 1 + patches)")
    max_bytes: int = Field(4 << 20, description="cap on bytes read for stdlib/text corpora")
    ignore_token: Optional[int] = Field(None, description="targets equal to this token id are left out of the "
                                                          "loss (padding); the loss is normalised by the valid "
                                                          "targets of the whole global batch")
    packing: Literal["none", "concat", "first_fit"] = Field(
        "none", description="none: windows at uniform offsets, blind to documents | concat: the same windows, "
                            "documents known | first_fit: whole documents placed into windows (longer ones cut), "
                            "the rest padding (gridshard.data.packing)")
    document_mask: bool = Field(False, description="attend only within a document and restart rotary positions "
                                                   "per document; a document's last target is not trained "
                                                   "(needs packing concat or first_fit)")
    hf_split: str = Field("train", description="hf/chat: the dataset split to train on")
    hf_text_field: str = Field("text", description="hf: the record field holding the text")
    hf_streaming: bool = Field(False, description="hf/chat: read the split as a stream (records in order, nothing "
                                                  "cached) instead of a memory-mapped dataset")
    tokenizer: Optional[str] = Field(None, description="hf/chat: a Hugging Face tokenizer.json to encode with, or "
                                                       "a tokenizer folder whose chat_template renders chat records "
                                                       "(null: bytes)")
    eod_token: Optional[int] = Field(None, description="the token that ends a document (default: a prepared "
                                                       "folder's record boundaries; stdlib/text: e.g. 10, a "
                                                       "newline)")


class TrainSection(BaseModel):
    """Batch, optimizer, schedule, precision and logging."""

    model_config = _STRICT
    global_batch: int = Field(16, description="sequences per optimizer step, over all data ranks")
    micro_batch: int = Field(4, description="sequences per forward/backward on one data rank")
    steps: int = Field(100, description="optimizer steps")
    lr: float = Field(3e-3, description="peak learning rate")
    min_lr: float = Field(3e-4, description="learning rate at the end of the decay")
    warmup_steps: int = Field(10, description="linear warm-up steps")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="decay after warm-up")
    decay_steps: Optional[int] = Field(None, description="step where decay ends (default: steps)")
    weight_decay: float = Field(0.1, description="AdamW decay of matrices and embeddings")
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = Field(1.0, description="max global gradient norm; 0 disables clipping")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a step whose gradient norm (every step) or loss (at log steps) is not finite: stop "
                            "the run before its update, naming the step and the last finite checkpoint (exit 3) | "
                            "skip its update (a warning; counted in the metrics' skipped_steps; the learning-rate "
                            "schedule moves on). fp16's loss-scaler overflows are skipped as always")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32 | bf16: parameters and gradients stored in bf16, fp32 master weights and AdamW "
                            "moments sharded by the ZeRO stage, autocast | fp16 (GPU): fp32 parameters, autocast "
                            "and loss scaling")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="with precision bf16: the data-parallel gradient reduction in fp32 (each bucket/unit "
                            "cast before it) | bf16 (the bf16 gradients reduced, the result cast to fp32); "
                            "precision fp32/fp16 reduce their fp32 gradients and accept only fp32")
    seed: int = Field(0, description="seeds the model initialisation and the batch order")
    log_interval: int = Field(10, description="steps between metrics lines")
    gc_interval: int = Field(50, description="Python's automatic garbage collection off during the run (after "
                                             "a full collection at its start), and a collection (generations "
                                             "0-1) on every rank after every this many "
                                             "steps, so its pauses do not make stragglers (Megatron's "
                                             "--manual-gc-interval, torchtitan's gc_freq); 0 = Python's automatic "
                                             "collection")
    save_interval: int = Field(0, description="steps between checkpoints under RUN_DIR/checkpoints; 0 = only at "
                                              "the end of the run")
    recompute: Literal["none", "full", "selective"] = Field(
        "none", description="activation recompute: none | full (every decoder layer) | selective (attention core + MLP "
                        "activation recomputed; norm outputs and silu(g)·u rebuilt in backward)")
    compile: bool = Field(False, description="torch.compile each decoder layer's forward (collectives stay "
                                             "eager between compiled pieces; same losses as eager)")
    compile_timeout_s: float = Field(900.0, description="with compile: the collective timeout until the first step "
                                                        "and first evaluation ran (ranks compile then; a pipeline's "
                                                        "last stage waits for the stages before it), then "
                                                        "collective_timeout_s")
    moe_aux_loss: float = Field(0.01, description="MoE: coefficient α of the per-sequence load-balancing loss "
                                                  "(docs/moe.md); 0 = off")
    moe_bias_rate: float = Field(0.0, description="MoE: step u of the auxiliary-loss-free balancing bias "
                                                  "(DeepSeek-V3); 0 = off")
    moe_capacity: Optional[float] = Field(None, description="MoE: capacity factor c (each expert takes at most "
                                                            "ceil(c·k·S/n) slots of a sequence); null = dropless")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO over the data dimension: 0 off | 1 optimizer state | "
                                                      "2 + gradients | 3 + parameters sharded by rows")
    offload: Literal["none", "optimizer"] = Field("none", description="optimizer: AdamW's state and step in host "
                                                                      "memory (GPU runs; no change on CPU)")
    zero3_host_memory: Optional[Literal["heap", "pages"]] = Field(
        None, description="ZeRO-3's host memory on a Linux CPU: unset (default) = pages for ZeRO-3 on a Linux "
                          "CPU, heap elsewhere, silently | pages (chunks and AdamW moments in one arena mapping, "
                          "layer buffers released by madvise: the resident saving ZeRO-3 predicts, at 2-7 % "
                          "more CPU per step; docs/memory.md; refused below ZeRO-3, warns on CUDA / off Linux) "
                          "| heap (torch's allocations through glibc's malloc)")
    keep_checkpoints: int = Field(3, description="complete checkpoints kept (oldest removed first); 0 = keep all")
    resume: str = Field("never", description="never | auto (the run directory's latest complete checkpoint, if "
                                             "any) | PATH (a checkpoint folder or a run directory)")
    allow_changed_schedule: bool = Field(False, description="resume even when the learning rate of the steps "
                                                            "still to run differs from the checkpoint's run (lr, "
                                                            "warmup, decay, steps); the change is logged. CLI: "
                                                            "--allow-changed-schedule")
    collective_timeout_s: float = Field(120.0, description="a collective waiting longer than this fails the job "
                                                           "(a dead rank ends the run instead of hanging it)")
    eval_interval: int = Field(50, description="steps between validation losses (and at the last step), when "
                                               "there is validation data; 0: only at the last step")
    eval_batches: int = Field(4, description="global batches of validation windows per evaluation (the same "
                                             "windows every time)")
    log_to: List[Literal["jsonl", "tensorboard"]] = Field(["jsonl"], description="metrics sinks: jsonl "
                                                          "(RUN_DIR/metrics.jsonl) and/or tensorboard (RUN_DIR/tb)")
    bucket_mb: float = Field(25.0, description="size of the data-parallel gradient all-reduce buckets")
    overlap_grad_reduce: bool = Field(True, description="issue each bucket's / unit's reduction during the backward "
                                                        "as soon as its gradients are complete (ZeRO-0/1: the last "
                                                        "micro-batch's, P = 1; ZeRO-2/3: every micro-batch's, with "
                                                        "pipeline stages too but zero_bubble); false: whole "
                                                        "gradients accumulate and are reduced once after the backward")
    peak_flops: Optional[float] = Field(None, description="dense peak FLOP/s of one device for MFU; default: the "
                                                          "datasheet figure of the GPU's exact name "
                                                          "(gridshard/peak_flops.py), none on CPU or an unknown GPU "
                                                          "(MFU then not reported)")
    tf32: bool = Field(True, description="fp32 runs on CUDA: matmuls and convolutions on TF32 tensor cores "
                                         "(torch.set_float32_matmul_precision('high'), cudnn.allow_tf32); no "
                                         "effect on CPU or with bf16/fp16")
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms(True): bitwise repeatable "
                                                   "GPU runs at some speed cost; on CUDA also set "
                                                   "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
    time_comm: Optional[bool] = Field(None, description="time collectives for comm_share; default: on for CPU, "
                                                         "off on CUDA (timing synchronises the GPU around each "
                                                         "collective and defeats SUMMA's overlap)")
    profile_start: Optional[int] = Field(None, description="record torch.profiler traces from this step (1-based; "
                                                           "null = off) into RUN_DIR/profile/rank{R}.trace.json "
                                                           "(docs/diagnosis.md)")
    profile_steps: int = Field(2, description="with profile_start: how many steps the traces cover")
    profile_ranks: Union[Literal["all"], List[int], None] = Field(
        None, description="with profile_start / profile_memory: the global ranks that record (all, or null = every rank)")
    profile_memory: bool = Field(False, description="CUDA: record the caching allocator's history from the first step; "
                                                    "a snapshot after the profiled steps "
                                                    "(RUN_DIR/profile/rank{R}.memory.pickle) and on out-of-memory "
                                                    "(rank{R}.oom.memory.pickle), for pytorch.org/memory_viz")


class TrainConfig(BaseModel):
    """The whole config (see the module docstring)."""

    model_config = _STRICT
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.data * p.pipeline * p.context * p.tensor

    def resolved(self) -> dict:
        """Plain dict with the model fields spelled out (what ``RUN_DIR/config.yaml`` holds);
        loading it back gives the same config."""
        out = self.model_dump()
        out["model"] = {"preset": self.model.preset, **vars(self.model.resolve())}
        if not out["model"].get("experts"):           # a dense model's file is what it was before MoE existed
            for key in ("experts",) + MOE_MODEL_FIELDS:
                out["model"].pop(key, None)
            for key in MOE_TRAIN_FIELDS:
                out["train"].pop(key)
        if self.model.kind != "llama":
            out["model"] = {"kind": self.model.kind, **out["model"]}
        for key in ("hf_config", "init_from"):
            if getattr(self.model, key) is not None:
                out["model"][key] = getattr(self.model, key)
        return out
