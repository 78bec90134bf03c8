"""A Llama-style decoder (RMSNorm, RoPE, causal SDPA attention with grouped-query heads,
SwiGLU), written once, plainly: no parallel code in it.

:func:`gridshard.parallelize` lays it out for a mesh by swapping its modules for
gridshard's 1D / sequence-parallel / 2D layers (plan :data:`gridshard.parallel.plan.LLAMA_PLAN`).
The module and parameter names are those of Hugging Face's ``LlamaForCausalLM`` without
its ``model.`` prefix, so importing Hugging Face weights is a rename, not a reshape.

Per layer, with h = hidden, H heads, K kv heads, d = h/H, f = ffn_hidden:

* ``self_attn.q_proj`` [H·d, h], ``k_proj`` / ``v_proj`` [K·d, h], ``o_proj`` [h, H·d];
* ``mlp.gate_proj`` / ``up_proj`` [f, h], ``down_proj`` [h, f];
* ``input_layernorm`` / ``post_attention_layernorm`` [h].

The code reads local sizes from the tensors it gets (``view(b, s, -1, d)``), so the same
forward runs on whole heads of one rank after tensor parallelism splits the projections.

Initialisation is a *law* per parameter (:meth:`Transformer.init_laws`), not a draw:
``parallelize`` evaluates it on each rank's block with the counter-based generator of
:mod:`gridshard.init`, so the values are a function of (seed, name, global index) only.
Laws: linear and embedding weights N(0, init_std²); the output projections of each
residual branch (``o_proj``, ``down_proj``) N(0, (init_std/√(2L))²); norm weights ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .rope import RopeTableCache, apply_rope


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn_hidden: int = 176
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    kv_heads: Optional[int] = None      # grouped-query attention; None = heads (multi-head)

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        """Global parameter count (no vocabulary padding):

            N = v·h·(1 if tied else 2) + L·(2h² + 2h·K·d + 3h·f + 2h) + h
        """
        h, f, v = self.hidden, self.ffn_hidden, self.vocab_size
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        return v * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + h


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Attention(nn.Module):
    """Causal self-attention with H query heads and K kv heads (K divides H)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.head_dim
        self.head_dim = d
        self.q_proj = _linear(cfg.hidden, cfg.heads * d)
        self.k_proj = _linear(cfg.hidden, cfg.kv_heads * d)
        self.v_proj = _linear(cfg.hidden, cfg.kv_heads * d)
        self.o_proj = _linear(cfg.heads * d, cfg.hidden)

    #: recompute the attention core (RoPE + softmax attention) in backward instead of keeping its
    #: activations (``train.recompute: selective``, :mod:`gridshard.parallel.recompute`); off
    #: unless :meth:`recompute_core_in_backward` turns it on
    recompute_core: bool = False

    def recompute_core_in_backward(self) -> None:
        """Keep only the core's inputs (q, k, v, cos, sin) for backward and run the core again there
        (non-reentrant ``torch.utils.checkpoint``): selective recompute. No collective is inside."""
        self.recompute_core = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.recompute_core:
            from torch.utils.checkpoint import checkpoint

            o = checkpoint(self.core, q, k, v, cos, sin, use_reentrant=False)
        else:
            o = self.core(q, k, v, cos, sin)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))

    @staticmethod
    def core(q, k, v, cos, sin) -> torch.Tensor:
        """RoPE on q, k and causal softmax attention: [b, H, s, d] → [b, H, s, d]."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class SwiGLUMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden, cfg.ffn_hidden)
        self.up_proj = _linear(cfg.hidden, cfg.ffn_hidden)
        self.down_proj = _linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Embedding → layers → final norm → head: tokens [b, s] → logits [b, s, V].

    Build it on ``torch.device("meta")`` and hand it to :func:`gridshard.parallelize`,
    which materialises each rank's shards; built on a real device it holds real values
    (``reset_parameters`` draws them from the counter RNG on one process)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rope_cache = RopeTableCache()       # built once per length and device, not saved
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_laws(self) -> dict:
        """Parameter name → ``("normal", std)`` / ``("ones",)`` / ``("zeros",)`` (module docstring)."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        laws = {}
        for name, p in self.named_parameters():
            if p.dim() == 1:
                laws[name] = ("ones",)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                laws[name] = ("normal", out_std)
            else:
                laws[name] = ("normal", std)
        return laws

    # The forward in pieces: what a pipeline stage runs of it (gridshard.pipeline.stage_module),
    # so the single-device forward and every stage share one description.
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] → hidden states (this rank's block of [b, s, h] once laid out)."""
        return self.embed_tokens(tokens)

    def layer_inputs(self, x: torch.Tensor, seq_len: int) -> tuple:
        """What every decoder layer reads besides the hidden states: the RoPE tables (cos, sin)
        [s, d] of the whole sequence (``seq_len``; under sequence parallelism ``x`` holds a block),
        built on the first call for this length and device and reused (``self.rope_cache``)."""
        return self.rope_cache.get(seq_len, self.cfg.head_dim, self.cfg.rope_theta, x.device)

    @staticmethod
    def run_layer(layer: nn.Module, x: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return layer(x, *inputs)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states → logits."""
        return self.lm_head(self.norm(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        inputs = self.layer_inputs(x, tokens.shape[-1])
        for layer in self.layers:
            x = self.run_layer(layer, x, inputs)
        return self.head(x)
