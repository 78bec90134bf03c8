"""A Llama-style decoder (RMSNorm, RoPE, causal SDPA attention, SwiGLU), written once.

Every layer comes from a :class:`gridshard.nn.style.TensorParallelStyle`, so the
same code is the single-device reference (``NoTensorParallel``), Megatron 1D (with
or without sequence parallelism) and SUMMA 2D. Activations between blocks are in
the style's *residual layout*; attention and the MLP's activation run on the
style's *split layout* (whole heads / whole neurons on each rank), so they need no
communication of their own.

Per block, the projections are

* ``qkv``: column, global weight [3h, h] fused as q|k|v (fused_parts=3);
* ``proj``: row, [h, h];
* ``gate_up``: column, [2f, h] fused as gate|up (fused_parts=2);
* ``down``: row, [h, f].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope, rope_tables


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        """Global parameter count (no vocabulary padding)."""
        h, f, v = self.hidden, self.ffn_hidden, self.vocab_size
        per_layer = 4 * h * h + 3 * h * f + 2 * h
        return v * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + h


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, style):
        super().__init__()
        self.local_heads = style.split_size(cfg.heads, "heads")
        self.head_dim = cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.qkv = style.column_linear(cfg.hidden, 3 * cfg.hidden, False, cfg.init_std, fused_parts=3)
        self.proj = style.row_linear(cfg.hidden, cfg.hidden, False, out_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                   # [b, s, 3·hl·d], full sequence
        b, s, _ = qkv.shape
        q, k, v = (t.reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class SwiGLUMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, style):
        super().__init__()
        style.split_size(cfg.ffn_hidden, "ffn_hidden")
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.gate_up = style.column_linear(cfg.hidden, 2 * cfg.ffn_hidden, False, cfg.init_std, fused_parts=2)
        self.down = style.row_linear(cfg.ffn_hidden, cfg.hidden, False, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, style):
        super().__init__()
        self.attn_norm = style.norm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, style)
        self.mlp_norm = style.norm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg, style)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), self.rope_cos, self.rope_sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Embedding → blocks → final norm → (vocab-parallel) head. ``forward`` takes this
    rank's tokens (``style.shard_tokens``) and returns this rank's logits; ``loss``
    returns the global mean cross-entropy, identical on every tensor rank."""

    def __init__(self, cfg: ModelConfig, style):
        super().__init__()
        self.cfg, self.style = cfg, style
        self.embed = style.embedding(cfg.vocab_size, cfg.hidden, cfg.init_std)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, style) for _ in range(cfg.layers))
        self.norm = style.norm(cfg.hidden, cfg.norm_eps)
        self.head = style.lm_head(cfg.hidden, cfg.vocab_size, cfg.init_std,
                                  tied=self.embed if cfg.tie_embeddings else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        return self.style.loss(self.forward(tokens), targets, ignore_index)
