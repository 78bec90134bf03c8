"""A plain pre-norm Vision Transformer (ViT) for image classification, written once: no
parallel code in it.

:func:`gridshard.parallelize` lays it out for a mesh by swapping its modules for gridshard's
1D / sequence-parallel / 2D layers (2.5D: 2D on each depth layer) or 3D layers
(:mod:`gridshard.tensor.tp3d.vision`; plan :data:`gridshard.parallel.plan.VIT_PLAN`). The module and
parameter names are those of Hugging Face's ``ViTForImageClassification``, so exporting to it or
importing from it is a copy by name, never a reshape.

Images x [b, C, H, W] (H = W = image_size, P = patch_size, n = (H/P)² patches, s = 1 + n tokens),
h = hidden, H_a heads of d = h/H_a, f = ffn_hidden, K = num_classes:

* ``vit.embeddings``: ``patch_embeddings.projection`` a P×P stride-P convolution
  (weight [h, C, P, P], bias [h]) → n patch vectors; ``cls_token`` [1, 1, h] prepended;
  ``position_embeddings`` [1, s, h] added;
* ``vit.encoder.layer.N`` (pre-norm): x += attention.output.dense(attn(layernorm_before(x)))
  with ``attention.attention.query | key | value`` [h, h] (+ bias) and full (non-causal) softmax
  attention; x += output.dense(gelu(intermediate.dense(layernorm_after(x)))) with
  ``intermediate.dense`` [f, h], ``output.dense`` [h, f] (+ biases); LayerNorms with bias;
* ``vit.layernorm`` on the last hidden states, then ``classifier`` [K, h] (+ bias) on the class
  token's row: logits [b, K].

The forward reads local sizes from the tensors it gets (``view(b, s, -1, d)``), so the same code
runs on whole heads of one rank after tensor parallelism splits the projections.

Initialisation laws (:meth:`VisionTransformer.init_laws`, evaluated per rank block by the counter
generator of :mod:`gridshard.init`): matrices, the convolution kernel, the class token and the
positions N(0, init_std²); biases zeros; LayerNorm weights ones (Hugging Face's ViT init with a
plain instead of a truncated normal).
"""
from __future__ import annotations

from dataclasses import dataclass, fields as dataclass_fields

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .llama import _recomputed


@dataclass
class ViTConfig:
    image_size: int = 16
    patch_size: int = 4
    channels: int = 1
    num_classes: int = 10
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn_hidden: int = 128
    norm_eps: float = 1e-12                 # Hugging Face ViT's layer_norm_eps
    init_std: float = 0.02

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ConfigError(f"model.image_size={self.image_size} is not divisible by model.patch_size="
                              f"{self.patch_size}: a ViT cuts the image into whole patches. Fix: choose a patch_size "
                              f"among the divisors of {self.image_size}.")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: the class token and n patches."""
        return 1 + self.num_patches

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_heads(self) -> int:
        """Multi-head attention: every query head has its own key/value head."""
        return self.heads

    tie_embeddings = False     # no output layer shares the input's weight (the pipeline's tied-weight sync reads it)
    #: the memory model's family (:mod:`gridshard.theory.memory.vision`) and the MLP's matrices (intermediate, output)
    family, mlp_matrices = "vit", 2
    experts = 0                # a dense encoder (the memory model and the laid-out blocks read it)

    def build(self) -> "VisionTransformer":
        """The plain model of this shape (on the current default device: build it under ``torch.device("meta")``)."""
        return VisionTransformer(self)

    def is_moe_layer(self, index: int) -> bool:
        return False

    @property
    def vocab_size(self) -> int:
        """The width of the output layer: the number of classes."""
        return self.num_classes

    def num_parameters(self) -> int:
        """Global parameter count:

            N = (C·P² + 1)·h + h + s·h  +  L·(4h² + 4h + 2h·f + f + h + 4h)  +  2h  +  K·h + K
        """
        h, f, C, P, K = self.hidden, self.ffn_hidden, self.channels, self.patch_size, self.num_classes
        embeddings = (C * P * P + 1) * h + h + self.seq_len * h
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        return embeddings + self.layers * per_layer + 2 * h + K * h + K


class ViTPatchEmbeddings(nn.Module):
    """Hugging Face's ``ViTPatchEmbeddings``: a stride-P convolution (``projection``)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.projection = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch_size, stride=cfg.patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[b, C, H, W] → [b, n, h]."""
        return self.projection(images).flatten(2).transpose(1, 2)


class ViTEmbeddings(nn.Module):
    """Patches, class token, positions: images [b, C, H, W] → [b, s, h].

    Laid out in 1D it stays as it is, replicated on every tensor rank: its parameters are
    (C·P² + 1 + s + 1)·h numbers (a few thousand for the digits model), its input is the
    whole image on every rank and its output the whole residual stream the 1D layers expect,
    so splitting it would save almost nothing and cost a collective. Its gradient is complete
    on every rank: the first column layer's input collective (an all-reduce of ∂L/∂x; under
    sequence parallelism the sequence scatter's all-gather) makes ∂L/∂x whole and identical
    before it reaches here. In 2D it becomes :class:`gridshard.tensor.tp2d.patch_embedding.ViTEmbeddings2D`, in
    3D :class:`gridshard.tensor.tp3d.vision.ViTEmbeddings3D`."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.image_size, self.channels = cfg.image_size, cfg.channels
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.patch_embeddings = ViTPatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.zeros(1, cfg.seq_len, cfg.hidden))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images, self.channels, self.image_size)
        y = self.patch_embeddings(images)
        cls = self.cls_token.expand(y.shape[0], -1, -1).to(y.dtype)
        return torch.cat([cls, y], dim=1) + self.position_embeddings.to(y.dtype)


def check_images(images: torch.Tensor, channels: int, size: int) -> None:
    if images.dim() != 4 or tuple(images.shape[1:]) != (channels, size, size):
        from ..errors import ShapeError

        raise ShapeError(f"the ViT expects images [b, {channels}, {size}, {size}], got {tuple(images.shape)}. "
                         f"Fix: resize the images to model.image_size with model.channels channels.")


class ViTSelfAttention(nn.Module):
    """query / key / value (with bias) and full softmax attention: [b, s, h] → [b, s, H·d]."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    #: recompute the attention core (softmax attention) in backward (``train.recompute: selective``,
    #: :mod:`gridshard.parallel.recompute`); off unless :meth:`recompute_core_in_backward` turns it on
    recompute_core: bool = False

    def recompute_core_in_backward(self) -> None:
        """Keep only q, k, v (the projections' outputs) for backward and run the core again there
        (non-reentrant ``torch.utils.checkpoint``): SDPA's own saved tensors (its output, the
        log-sum-exp) are not kept. Part of selective recompute; no collective is inside."""
        self.recompute_core = True

    @staticmethod
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full (non-causal) softmax attention: [b, H, s, d] → [b, H, s, d]."""
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        o = _recomputed(self.core, q, k, v) if self.recompute_core else self.core(q, k, v)
        return o.transpose(1, 2).reshape(b, s, -1)


class Children(nn.Module):
    """A module that only holds the named ``children``: one of Hugging Face's forward-less containers
    (``ViTModel``, ``ViTEncoder``, ``ViTSelfOutput``, ``ViTIntermediate``, ``ViTOutput``), whose names
    are all the parameter names need."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class ViTAttention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.attention = ViTSelfAttention(cfg)
        self.output = Children(dense=nn.Linear(cfg.hidden, cfg.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output.dense(self.attention(x))


class ViTLayer(nn.Module):
    """Pre-norm block: x + attention(layernorm_before(x)), then + mlp(layernorm_after(x)),
    mlp = output.dense(gelu(intermediate.dense(·))) (exact GELU, Hugging Face's ``"gelu"``).

    Kept for backward by the MLP: u = intermediate.dense(·) (GELU's input) and gelu(u)
    (output.dense's input), two f-wide tensors; with :meth:`recompute_activation_in_backward`
    the same two — GELU keeps u and output.dense keeps gelu(u) either way, so rebuilding gelu(u)
    from u in backward saves no tensor here, unlike SwiGLU's silu(g) — but the activation runs
    in its own checkpoint region as the Llama's does, so ``selective`` means the same regions for
    both families (attention core + MLP activation)."""

    #: recompute gelu(u) in backward (``train.recompute: selective``); off by default
    recompute_activation: bool = False

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.layernorm_before = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = ViTAttention(cfg)
        self.layernorm_after = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.intermediate = Children(dense=nn.Linear(cfg.hidden, cfg.ffn_hidden))
        self.output = Children(dense=nn.Linear(cfg.ffn_hidden, cfg.hidden))

    def recompute_activation_in_backward(self) -> None:
        """Compute gelu(u) again in backward from u = intermediate.dense(·) (no collective)."""
        self.recompute_activation = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.layernorm_before(x))
        u = self.intermediate.dense(self.layernorm_after(x))
        act = _recomputed(F.gelu, u) if self.recompute_activation else F.gelu(u)
        return x + self.output.dense(act)


class ClsClassifier(nn.Linear):
    """The classifier [K, h] (+ bias) applied to the class token's row: [b, s, h] → [b, K]
    (Hugging Face applies ``classifier`` to ``sequence_output[:, 0]``; taking the row inside the
    module lets the 1D / sequence-parallel / 2D heads find it in their own blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[:, 0])


class VisionTransformer(nn.Module):
    """images [b, C, H, W] → logits [b, K] (module docstring). Build it on ``torch.device("meta")``
    and hand it to :func:`gridshard.parallelize` (plan :data:`gridshard.parallel.plan.VIT_PLAN`)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.vit = Children(embeddings=ViTEmbeddings(cfg),
                            encoder=Children(layer=nn.ModuleList(ViTLayer(cfg) for _ in range(cfg.layers))),
                            layernorm=nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps))
        self.classifier = ClsClassifier(cfg.hidden, cfg.num_classes)

    def init_laws(self) -> dict:
        """Parameter name → ``("normal", std)`` / ``("ones",)`` / ``("zeros",)`` (module docstring)."""
        return {name: ("zeros",) if name.endswith("bias") else ("ones",) if p.dim() == 1
                else ("normal", self.cfg.init_std) for name, p in self.named_parameters()}

    # The forward in pieces, as the Llama's (embed → layer_inputs → run_layer → head): what a
    # pipeline stage runs of it (gridshard.pipeline.split.ViTRankModel, stage_module.StageModule).
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """images [b, C, H, W] → hidden states [b, s, h] (under autocast in the compute dtype:
        the convolution's output dtype, which the class token and positions are cast to)."""
        return self.vit.embeddings(images)

    @staticmethod
    def hidden_dtype(compute: torch.dtype) -> torch.dtype:
        """The dtype of the hidden states between layers (and pipeline stages): the compute dtype."""
        return compute

    def layer_inputs(self, x: torch.Tensor, seq_len: int) -> tuple:
        """What an encoder layer reads besides the hidden states: nothing (learned positions are
        added once, in ``embed``; attention is unmasked)."""
        return ()

    @staticmethod
    def run_layer(layer: nn.Module, x: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return layer(x, *inputs)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and the classifier on the class token: hidden states → logits [b, K]."""
        return self.classifier(self.vit.layernorm(x))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        inputs = self.layer_inputs(x, x.shape[1])
        for layer in self.vit.encoder.layer:
            x = self.run_layer(layer, x, inputs)
        return self.head(x)


def hf_vit_config_fields(cfg: ViTConfig) -> dict:
    """The Hugging Face ``config.json`` of ``ViTForImageClassification`` with this architecture (what
    ``gridshard export`` writes; no ``transformers`` needed). Labels are the class indices."""
    labels = {str(k): str(k) for k in range(cfg.num_classes)}
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": cfg.hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "intermediate_size": cfg.ffn_hidden,
            "hidden_act": "gelu", "layer_norm_eps": cfg.norm_eps, "image_size": cfg.image_size,
            "patch_size": cfg.patch_size, "num_channels": cfg.channels, "qkv_bias": True,
            "initializer_range": cfg.init_std, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}, "torch_dtype": "float32"}


def saved_model_config(model: dict):
    """The :class:`ViTConfig` (``kind: vit``) or :class:`gridshard.models.llama.ModelConfig` a saved config's
    ``model`` section describes; its keys the class has no field for (``kind``, ``preset``, ``hf_config``)
    are not the model's shape and are skipped."""
    from .llama import ModelConfig

    cls = ViTConfig if model.get("kind") == "vit" else ModelConfig
    names = {f.name for f in dataclass_fields(cls)}
    return cls(**{k: v for k, v in model.items() if k in names})


def vit_config(fields: dict) -> ViTConfig:
    """A :class:`ViTConfig` from a config's explicit ``model`` fields (``model.kind: vit``): the ones
    a ViT has over its defaults; a decoder-only field is a ConfigError naming it."""
    known = {f.name for f in dataclass_fields(ViTConfig)}
    wrong = sorted(set(fields) - known)
    if wrong:
        raise ConfigError(f"model.{wrong[0]} is not a Vision Transformer field (model.kind=vit has "
                          f"{sorted(known)}). Fix: remove {['model.' + w for w in wrong]}, or use model.kind: llama.")
    return ViTConfig(**fields)
