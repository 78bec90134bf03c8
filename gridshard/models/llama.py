"""A Llama-style decoder (RMSNorm, RoPE, causal SDPA attention with grouped-query heads,
SwiGLU), written once, plainly: no parallel code in it.

:func:`gridshard.parallelize` lays it out for a mesh by swapping its modules for
gridshard's 1D / sequence-parallel / 2D layers (plan :data:`gridshard.parallel.plan.LLAMA_PLAN`).
The module and parameter names are those of Hugging Face's ``LlamaForCausalLM`` without
its ``model.`` prefix, so importing Hugging Face weights is a rename, not a reshape.

Per layer, with h = hidden, H heads, K kv heads, d = h/H, f = ffn_hidden:

* ``self_attn.q_proj`` [H·d, h], ``k_proj`` / ``v_proj`` [K·d, h], ``o_proj`` [h, H·d];
* ``mlp.gate_proj`` / ``up_proj`` [f, h], ``down_proj`` [h, f];
* ``input_layernorm`` / ``post_attention_layernorm`` [h];
* an MoE layer's ``mlp`` instead (n experts of width f_e, :mod:`gridshard.moe`): ``gate.weight`` [n, h]
  (the router), ``experts.gate_up_proj`` [n, 2f_e, h], ``experts.down_proj`` [n, h, f_e] (Hugging
  Face's ``MixtralForCausalLM`` names) and, with s shared experts, ``shared_experts.*`` of one expert
  of width s·f_e.

The code reads local sizes from the tensors it gets (``view(b, s, -1, d)``), so the same
forward runs on whole heads of one rank after tensor parallelism splits the projections.

Initialisation is a *law* per parameter (:meth:`Transformer.init_laws`), not a draw:
``parallelize`` evaluates it on each rank's block with the counter-based generator of
:mod:`gridshard.init`, so the values are a function of (seed, name, global index) only.
Laws: linear and embedding weights N(0, init_std²); the output projections of each
residual branch (``o_proj``, ``down_proj``, the experts' too) N(0, (init_std/√(2L))²); norm weights ones;
the router N(0, init_std²).

Precision: under ``torch.autocast`` (``train.precision: bf16 | fp16``) the activations are in the
compute dtype c: the embedding output is cast to c, so the residual stream, the norms' outputs
(computed in fp32 inside, :func:`gridshard.nn.norm.rms_norm`), the projections and the RoPE tables
(cached in c, built in fp32) are all in c; only the loss upcasts the logits to fp32
(:meth:`gridshard.parallel.model_context.ParallelContext.model_loss`). Parameters keep their own dtype.
Without autocast nothing is cast: an fp32 run is what it was, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..context.sequence_split import global_positions
from ..moe.layer import MoEBlock
from ..nn.documents import document_inputs
from ..nn.norm import RMSNorm
from ..nn.swiglu import swiglu
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
    # Mixture-of-Experts (docs/moe.md): experts = 0 is dense; else layer i is an MoE block when
    # (i + 1) % moe_every == 0 (every layer at 1, as Mixtral; Qwen2-MoE's decoder_sparse_step)
    experts: int = 0
    experts_per_token: int = 2
    expert_ffn_hidden: Optional[int] = None     # None = ffn_hidden
    shared_experts: int = 0                     # always-on experts, as one MLP of shared·expert_ffn_hidden
    moe_every: int = 1
    router_score: str = "softmax"               # softmax | sigmoid
    router_normalize: bool = True               # divide the top-k weights by their sum

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.expert_ffn_hidden is None:
            self.expert_ffn_hidden = self.ffn_hidden

    #: the memory model's family (:mod:`gridshard.theory.memory`) and the MLP's matrices (gate, up, down)
    family, mlp_matrices = "decoder", 3

    def build(self) -> "Transformer":
        """The plain model of this shape (on the current default device: build it under ``torch.device("meta")``)."""
        return Transformer(self)

    def is_moe_layer(self, index: int) -> bool:
        return self.experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self, active: bool = False) -> int:
        """Global parameter count (no vocabulary padding):

            N = v·h·(1 if tied else 2) + Σ_layers (2h² + 2h·K·d + 2h + MLP) + h

        MLP = 3h·f for a dense layer; for an MoE layer (n experts of width f_e, s shared)
        n·3h·f_e + h·n (router) + 3h·s·f_e, or with ``active`` the parameters one token uses,
        k·3h·f_e + h·n + 3h·s·f_e.
        """
        h, f, v, fe = self.hidden, self.ffn_hidden, self.vocab_size, self.expert_ffn_hidden
        kv = self.kv_heads * self.head_dim
        moe = ((self.experts_per_token if active else self.experts) + self.shared_experts) * 3 * h * fe \
            + h * self.experts
        mlps = sum(moe if self.is_moe_layer(i) else 3 * h * f for i in range(self.layers))
        per_layer = 2 * h * h + 2 * h * kv + 2 * h
        return v * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + mlps + h


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype activations are kept in: autocast's dtype inside ``torch.autocast`` on x's
    device, else x's own (module docstring, "Precision")."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


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
        """Keep only the core's inputs (q, k, v before RoPE; the shared cos, sin) for backward and
        run the core again there (non-reentrant ``torch.utils.checkpoint``): part of selective
        recompute. No collective is inside, except under context parallelism: there the ring's
        sends (or the all-to-alls) of :attr:`context_attention` run again, on every context rank
        in the same order."""
        self.recompute_core = True

    #: context parallelism (``parallel.context`` C > 1): causal attention of this rank's 2c tokens
    #: over the whole sequence split on the context axis, ``attend(q, k, v)`` (ring or all-to-all,
    #: :mod:`gridshard.context`), set by :meth:`attend_over_context`; None: plain causal SDPA
    context_attention = None

    def attend_over_context(self, attend) -> None:
        """Attend with ``attend(q, k, v) -> o`` ([b, H, 2c, d] after RoPE, this rank's chunks of a
        sequence split over the context axis) instead of causal SDPA on the local tokens
        (``gridshard.parallelize`` on a mesh with a context axis)."""
        self.context_attention = attend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        o = _recomputed(self.core, q, k, v, cos, sin, documents) if self.recompute_core \
            else self.core(q, k, v, cos, sin, documents)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))

    def core(self, q, k, v, cos, sin, documents=None) -> torch.Tensor:
        """RoPE on q, k and causal softmax attention: [b, H, s, d] → [b, H, s, d] (cos, sin: the
        tables at the tokens' global positions; under context parallelism the attention crosses
        the context axis, :attr:`context_attention`). With ``documents``
        (:class:`gridshard.nn.documents.DocumentMask`, packed windows) the attention is
        document-causal: SDPA with the shared additive mask, or the context attention given the
        whole sequence's document ids."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if self.context_attention is not None:
            return self.context_attention(q, k, v) if documents is None else \
                self.context_attention(q, k, v, documents=documents.ids)
        if documents is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _recomputed(fn, *args) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args`` for backward and running ``fn`` again there
    (non-reentrant ``torch.utils.checkpoint``, autocast state and RNG state replayed)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) · up(x)). Kept for backward, in every recompute mode (:func:`swiglu`): gate's
    output g and up's output u (silu(g) is rebuilt from g in backward, as Megatron's fused
    ``bias_swiglu`` does) and the product (down's input): three f-wide tensors; with
    :meth:`rebuild_output_in_backward` (``train.recompute: selective``), two: down keeps the recipe
    (g, u) of the product, not the product (:mod:`gridshard.nn.rebuild`)."""

    #: the decoder layer's :class:`gridshard.nn.rebuild.RebuildRegion` the product is offered to
    #: (``train.recompute: selective``); None unless :meth:`rebuild_output_in_backward` sets it
    rebuild = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden, cfg.ffn_hidden)
        self.up_proj = _linear(cfg.hidden, cfg.ffn_hidden)
        self.down_proj = _linear(cfg.ffn_hidden, cfg.hidden)

    def rebuild_output_in_backward(self, region) -> None:
        """Offer silu(g)·u to ``region`` with its recipe (g, u): down_proj keeps that, not the product."""
        self.rebuild = region

    @staticmethod
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(g)·u as a plain expression: the rebuild's recipe (run with gradients off; the same
        ops, so the same bits, as :func:`swiglu`'s forward)."""
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = swiglu(gate, up)
        if self.rebuild is not None:
            self.rebuild.offer(act, self.activation, gate, up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the MLP of layer ``index`` is an
    MoE block (:class:`gridshard.moe.layer.MoEBlock`) where ``cfg.is_moe_layer(index)``."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MoEBlock(cfg.hidden, cfg.experts, cfg.experts_per_token, cfg.expert_ffn_hidden,
                            cfg.shared_experts * cfg.expert_ffn_hidden, cfg.router_score, cfg.router_normalize,
                            layer=index) \
            if cfg.is_moe_layer(index) else SwiGLUMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
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
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_laws(self) -> dict:
        """Parameter name → ``("normal", std)`` / ``("ones",)`` / ``("zeros",)`` (module docstring)."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        return {name: ("ones",) if p.dim() == 1 else ("normal", out_std)
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else ("normal", std)
                for name, p in self.named_parameters()}

    # The forward in pieces: what a pipeline stage runs of it (gridshard.pipeline.stage_module),
    # so the single-device forward and every stage share one description.
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] → hidden states (this rank's block of [b, s, h] once laid out), in the
        compute dtype (module docstring, "Precision")."""
        x = self.embed_tokens(tokens)
        return x.to(compute_dtype(x))

    @staticmethod
    def hidden_dtype(compute: torch.dtype) -> torch.dtype:
        """The dtype of the hidden states between layers (and pipeline stages) when the run
        computes in ``compute``: that dtype itself (module docstring, "Precision")."""
        return compute

    #: (C, context rank) of the tokens this model sees; (1, 0): whole sequences (:meth:`split_sequence`)
    context_split: tuple = (1, 0)

    def split_sequence(self, context_size: int, context_rank: int) -> None:
        """Context parallelism: this model sees context rank ``context_rank``'s 2c tokens of every
        sequence (chunks i and 2C − 1 − i), so RoPE reads the tables at their global positions
        (:func:`gridshard.context.sequence_split.global_positions`; set by ``gridshard.parallelize``)."""
        self.context_split = (context_size, context_rank)

    def layer_inputs(self, x: torch.Tensor, seq_len: int, documents=None) -> tuple:
        """What every decoder layer reads besides the hidden states: the RoPE tables (cos, sin)
        [s, d] of the whole sequence (``seq_len``; under sequence parallelism ``x`` holds a block)
        in x's dtype, built (in fp32) on the first call for this length, device and dtype and
        reused (``self.rope_cache``): one pair per model, shared by every layer and micro-batch.
        Under context parallelism ``seq_len`` = 2c is this rank's part and the rows are those of
        its tokens' global positions (:meth:`split_sequence`).

        With ``documents`` (the document ids [b, S] of the micro-batch's whole sequences, packed
        windows: :mod:`gridshard.nn.documents`) the tables are per token, [b, s, d], at each token's
        position within its document, and a third input, the
        :class:`gridshard.nn.documents.DocumentMask`, makes attention document-causal; both are
        built once per micro-batch and shared by every layer."""
        if documents is None:
            return self.rope_cache.get(seq_len, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype,
                                       context=self.context_split)
        cos, sin = self.rope_cache.get(documents.shape[-1], self.cfg.head_dim, self.cfg.rope_theta, x.device,
                                       x.dtype)
        C, rank = self.context_split
        local = global_positions(seq_len, C, rank, device=x.device) if C > 1 else None
        return document_inputs(documents.to(x.device), cos, sin, local)

    @staticmethod
    def run_layer(layer: nn.Module, x: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return layer(x, *inputs)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states → logits."""
        return self.lm_head(self.norm(x))

    def forward(self, tokens: torch.Tensor, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] → logits; ``documents`` [b, S]: the document ids of packed windows
        (:meth:`layer_inputs`)."""
        x = self.embed(tokens)
        inputs = self.layer_inputs(x, tokens.shape[-1], documents)
        for layer in self.layers:
            x = self.run_layer(layer, x, inputs)
        return self.head(x)
