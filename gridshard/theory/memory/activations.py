"""Memory per rank, §2: activations kept for backward, by tensor mode and recompute.

Notation: see :mod:`gridshard.theory.memory`.

2. Activations (:func:`activation_bytes`)
=========================================
The bytes autograd keeps for backward during one micro-batch's forward (counted once per
storage; parameters excluded), derived for gridshard's Llama block op by op as
Korthikanti et al. (2022) did for GPT. e = bytes of an activation element: 4 in fp32, 2 under
bf16/fp16 autocast, where gridshard's model keeps its activations in the compute dtype
(:mod:`gridshard.models.llama`, "Precision": the embedding output is cast, so the residual
stream, the norms' outputs, q/k/v, the MLP tensors and the RoPE tables are e-byte); what stays
fp32 is written with 4: the norms' rstd, the attention log-sum-exp, the loss's softmax, and
ids (8) and masks (1). Let the rank's token rows be
N_r = N (none, 1D) or N/q (2D: the batch is split over grid rows); the residual stream
per rank is R = N·h (none, 1D), N·h/T (1D+SP: the sequence is split), N·h/q² (2D);
H_r, K_r, f_r the rank's heads, kv heads and MLP width: (H, K, f) without tensor
parallelism, (H/T, K/min(T, K), f/T) in 1D (kv heads replicated in groups when T > K),
(H/q, K/q, f/q) in 2D.
3D (T = q³, issue 24; the layers of docs/tp3d.md): N_r = N/q² (batch block i·q + j of q²), R = N·h/q³,
(H/q, K/q, f/q), logits V_p/q with V_p = ⌈V/q⌉·q. Every Linear3D keeps only its input block
(N·in/q³, 1/T of one device's; the gathered X and W are gathered again in backward; V_p = ⌈V/q²⌉·q²
with a tied head, the embedding's padding), which is a
tensor the table below already counts (the norm output, the attention output, silu(g)·u); the norms
and the loss are 2D's functions on the cube's ``output`` axis (2D's rows below with q the cube side);
the embedding gathers the whole micro-batch's ids over ``batch`` (N·8 + the N·1 mask, as 2D's);
no weight copies (the matmul saves the parameter block and casts inside); under ``selective`` the
3D norms' outputs are rebuilt as 2D's are; a tied head keeps a copy of its weight slice of the gathered
table (:func:`gridshard.tensor.tp3d.scheme.tied_head_saved_bytes`). Asserted against the meter on all 8 ranks of a q = 2 cube,
every recompute mode, fp32 and bf16, tied and untied (``tests/test_planner_3d.py``, wide).

* **RMSNorm** (twice per layer). It keeps its input x (R·e) and the reciprocal rms (R/h·4, one
  per token); in fp32 also the normalised x̂ = x·rstd (R·4: ``F.rms_norm`` on CPU runs as pow,
  mean, rsqrt, mul, mul; a fused CUDA kernel may keep x and rstd only — not measured here),
  while a bf16/fp16 x goes through :func:`gridshard.nn.norm.rms_norm`'s own backward, which
  rebuilds x̂ (as a fused kernel does). The output y = x̂·w is kept by the
  projections that read it (R·e; under SP that is the sequence block, N·h/T·e: the column
  layers keep their block and all-gather it again in backward,
  :mod:`gridshard.tensor.tp1d.input_grad_overlap`, instead of keeping the gathered N·h·e). 2D
  (``RMSNorm2D``, one autograd function, fp32 arithmetic inside) keeps x (R·e), the rms
  (N_r·4), the gathered weight block (h/q·4) and, through the SUMMA product, y (R·e).
* **q|k|v** (one matmul on the shared input): keeps that input (counted above). Their
  outputs are kept by RoPE/attention below.
* **Attention core** (RoPE + ``scaled_dot_product_attention``, causal). RoPE's multiplies
  keep only the cos/sin tables ([s, d] each, e-byte: the model's cache,
  :class:`gridshard.models.rope.RopeTableCache`, one pair for every layer and micro-batch,
  so **held once per rank**, 2·s·d·e, not per micro-batch in flight). PyTorch's SDPA on these
  shapes is the flash kernel (measured on CPU; GPU flash / memory-efficient kernels keep the
  same set): it keeps rotated q (N_r·H_r·d·e), rotated k and v (N_r·K_r·d·e each), its output
  (N_r·H_r·d·e) and the log-sum-exp (N_r·H_r·4), *not* the s×s score matrix —
  Korthikanti's 5·a·s²·b term belongs to an unfused softmax (and dropout, which we lack).
* **o_proj** (row/2D): keeps its input, which is the attention output already counted
  (a view of the same storage).
* **MLP** (:func:`gridshard.nn.swiglu.swiglu`, in every recompute mode): gate output g and up
  output u (the SwiGLU's inputs; silu(g) is rebuilt from g in backward, as Megatron's fused
  ``bias_swiglu`` does) and the product (down's input): 3·N_r·f_r·e. (Written plainly,
  ``F.silu(g) * u`` would keep silu(g) as a fourth.)
* Residual additions keep nothing.

Per layer, recompute ``none``::

    2·norm + N_r·d·(2·H_r + 2·K_r)·e + N_r·H_r·4 + 3·N_r·f_r·e
    norm = R·e + R·4 + R/h·4 + R·e      fp32: x, x̂, rstd, y   (none, 1D, 1D + SP; y the block under SP)
         = R·e + R/h·4 + R·e            bf16/fp16: x, rstd, y
         = 2R·e + N_r·4 + h/q·4         2D, any precision

``selective`` (:mod:`gridshard.parallel.recompute`: the attention core is a non-reentrant
checkpoint, and the norm outputs and the product silu(g)·u are *rebuilt*,
:mod:`gridshard.nn.rebuild`): the core keeps its inputs — q, k, v before RoPE (same sizes as
after) and the shared cos/sin — instead of its activations, and its output stays kept by
o_proj; the SwiGLU keeps g and u (as under ``none``); the consumers of the two norm outputs
(q|k|v, gate|up) and of the product (down) keep recipes over tensors kept anyway (x̂ and w, or x,
rstd and w; g and u), not the tensors. The layer saves the log-sum-exp N_r·H_r·4, the product
(N_r·f_r·e) and the two norm outputs (2·R·e) less::

    2·norm_r + N_r·d·(2·H_r + 2·K_r)·e + 2·N_r·f_r·e
    norm_r = norm − R·e            (x, x̂, rstd fp32; x, rstd bf16/fp16; 2D: x, the rms, the w block)

The final norm (before the head) is outside the decoder layers and keeps y in every mode.

``full``: each decoder layer keeps only its input, R·e (+ the shared cos/sin).

**Weight copies** (:func:`weight_copy_bytes`; bf16/fp16 with fp32 parameters only). Autocast
multiplies an fp32 weight through an e-byte copy, and autograd keeps the copy wherever the
matmul saves its weight operand: every projection and the head in mode none (``F.linear``) and
in 2D (SUMMA), only the row layers (o_proj, down_proj) in 1D, whose column layers save the
fp32 parameter itself and cast again in backward. Per decoder layer (not under ``full``:
the checkpointed forward's copies are dropped) e·(h·d·(2H+2K) + 3·h·f) (none; the local blocks
in 2D) or e·h·(H_r·d + f_r) (1D); the head e·h·V (none) or e·h/q·V_p/q (2D) on the last stage.
Autocast caches the copy for its region (a micro-batch's forward; the whole schedule of a
pipeline step), so they are **held once per rank**, not per micro-batch. They vanish when the
parameters are stored in the compute dtype (``param_bytes = e``). Not modelled: 1D without SP
with ``parallel.overlap_input_grad: false``, whose column layers go through ``F.linear`` and
keep copies too.

For comparison with Korthikanti et al.'s s·b·h·(34 + 5·a·s/h)/t bytes per GPT layer with TP
and SP (2-byte activations, 1-byte dropout masks): ours with K = H and f = 8h/3, in units of
s·b·h/t bytes (terms in 1/h and 1/d dropped)::

                 bf16 / fp16 (e = 2)     fp32 (e = 4)     Korthikanti (2-byte)
    none         37.3                    82.7              34 + 5·a·s/h
    selective    22.7                    53.3              34
    full         2                       4                 2

``docs/memory.md`` itemises the difference term by term (the s² term of an unfused softmax,
SwiGLU's f-wide tensors with f = 8h/3 against GELU's 4h, no dropout masks, fp32's x̂; under
``selective`` Megatron keeps the norm outputs and the GELU input and output, which we rebuild
or do not have: 22.7 against 34).

Outside the layers (first / last pipeline stage):

* embedding: T = 1: the token ids (N·8); vocab-parallel (1D T > 1, 2D): the local ids
  (N·8; 2D: the column-gathered [b, s] ids) and the out-of-range mask (N·1);
* final norm: one norm as above (its output kept by the head);
* head + loss (the **logits**): the loss upcasts the logits to fp32 in any precision. No TP:
  ``F.cross_entropy`` keeps the fp32 log-softmax N·V·4, the targets N·8 and a 4-byte total
  weight; 1D: the fp32 softmax block N·V_p/T·4, target index N·8 and two masks N·1; 2D:
  softmax N_r·V_p/q·4, index N_r·8, two masks N_r·1 and a 4-byte weight.

Asserted (``tests/test_memory_model.py``): the total equals the saved-tensor meter to the byte
for none / selective / full, in fp32 and under bf16 autocast on CPU, at T = 1 (none and 1D),
1D, 1D + SP (T = 2, 4, kv heads replicated), 2D (tied, grouped-query).

Context parallelism (``context`` C > 1, issue 25): every per-token tensor above holds the rank's
b·S/C tokens (the RoPE tables too, 2·(S/C)·d·e), and under recompute ``none`` each layer keeps one
more copy of the attention output, n·H_r·d·e (:func:`gridshard.theory.context.context_attention_saved_bytes`);
asserted against the meter for ring and all-to-all, every recompute mode, fp32 and bf16. The
attention's backward buffers (:func:`gridshard.theory.context.context_transient_bytes`) count in §3.

Pipeline (:func:`gridshard.theory.pipeline.peak_in_flight`): stage i of P holds the
activations of up to min(A, P − i) micro-batches under 1F1B, all A under GPipe
(:attr:`ActivationBytes.per_microbatch` each; the RoPE tables and weight copies once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...job_layout import TensorMode
from ..context import context_attention_saved_bytes
from ..moe import moe_layer_saved_tensors
from ..pipeline import DTYPE_BYTES
from .model_state import FP32
from .vision import is_vision, vit_activation_terms, vit_logits_workspace_bytes


# ---------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------
@dataclass
class ActivationBytes:
    """Bytes kept for backward by one micro-batch's forward on one rank (module docstring §2).
    ``rope_tables`` and ``weight_copies`` are held once per rank whatever the micro-batches in
    flight (the model's RoPE cache; autocast's weight copies, cached for the autocast region)."""

    per_layer: int
    layers: int
    rope_tables: int
    embedding: int
    final_norm: int
    head_and_loss: int
    weight_copies: int = 0
    moe_layers: int = 0              # of ``layers``, the MoE ones (:func:`gridshard.theory.moe.moe_layer_saved_tensors`)
    per_moe_layer: int = 0
    documents: int = 0               # packed windows' per-token tables and mask (:func:`document_mask_bytes`)

    @property
    def decoder(self) -> int:
        return self.per_layer * (self.layers - self.moe_layers) + self.per_moe_layer * self.moe_layers

    @property
    def per_microbatch(self) -> int:
        """What each micro-batch in flight adds: decoder layers, embedding, final norm, head + loss
        (and, on packed windows, their document tables and mask)."""
        return self.decoder + self.embedding + self.final_norm + self.head_and_loss + self.documents

    @property
    def held_once(self) -> int:
        """What the rank holds once, however many micro-batches are in flight."""
        return self.rope_tables + self.weight_copies

    @property
    def total(self) -> int:
        """One micro-batch's forward: what the saved-tensor meter counts."""
        return self.per_microbatch + self.held_once


@dataclass(frozen=True)
class RankShape:
    """Per-rank sizes of one micro-batch in one tensor mode (module docstring §2), answered by the
    mode's scheme (:meth:`gridshard.tensor.base.Scheme.rank_shape`)."""

    token_rows: int           # N_r
    residual: int             # R elements of the residual stream
    heads: int                # H_r
    kv_heads: int             # K_r
    ffn: int                  # f_r
    vocab_block: int          # logits columns of this rank


def _rank_shape(cfg, mode, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
    return TensorMode.parse(mode).rank_shape(cfg, T, sequence_parallel, tokens)


def activation_element_bytes(precision: str) -> int:
    """e: bytes of an activation element under ``train.precision`` (4 fp32, 2 bf16/fp16)."""
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision is {precision!r}, not one of {sorted(DTYPE_BYTES)}. Fix: use one of them.")
    return DTYPE_BYTES[precision]


def norm_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, e: int = FP32,
                     rebuilt: bool = False) -> int:
    """One RMSNorm and the input its consumer keeps (module docstring §2, ``norm``): x, the fp32
    rstd and y, plus x̂ for fp32 (``F.rms_norm`` decomposed) outside 2D. ``rebuilt`` (a decoder
    layer's norm under ``selective``, :mod:`gridshard.nn.rebuild`): y is not kept."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    consumer_input = 0 if rebuilt else r.residual * e   # y itself (under SP its sequence block, re-gathered)
    return TensorMode.parse(mode).norm_saved_bytes(cfg, T, r, e, consumer_input)


def layer_saved_tensors(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                        e: int = FP32, context: int = 1, context_mode: str = "ring") -> dict:
    """What one decoder layer keeps for backward, tensor by tensor (module docstring §2): name →
    bytes, in forward order; the two norms as one entry each (:func:`norm_saved_bytes`). Under
    ``none`` the SwiGLU keeps g and u, not silu(g) (rebuilt from g in backward:
    :func:`gridshard.nn.swiglu.swiglu`), and down_proj the product. Under
    ``selective`` q, k, v are the core's inputs (before RoPE, same sizes), ``lse`` and
    ``silu(g)·u`` are absent and the norms keep x and rstd (+ x̂ in fp32) but not y (rebuilt
    in backward, :mod:`gridshard.nn.rebuild`); ``full`` keeps the layer input only. ``context`` C > 1
    (``tokens`` already the rank's b·2c): the attention output o_proj keeps is a copy
    (:func:`gridshard.theory.context.context_attention_saved_bytes`)."""
    r = _rank_shape(cfg, mode, T, sequence_parallel, tokens)
    if recompute == "full":
        return {"input": r.residual * e}
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    n, d, f = r.token_rows, cfg.head_dim, r.token_rows * r.ffn * e
    if recompute == "selective":    # the core's log-sum-exp recomputed, y and silu(g)·u rebuilt
        norm = norm_saved_bytes(cfg, mode, T, sequence_parallel, tokens, e, rebuilt=True)
        return {"attn_norm (x, rstd)": norm, "q": n * r.heads * d * e, "k": n * r.kv_heads * d * e,
                "v": n * r.kv_heads * d * e, "attention output": n * r.heads * d * e,
                "mlp_norm (x, rstd)": norm, "gate g": f, "up u": f}
    norm = norm_saved_bytes(cfg, mode, T, sequence_parallel, tokens, e)
    out = {"attn_norm (x, rstd, y)": norm, "q": n * r.heads * d * e, "k": n * r.kv_heads * d * e,
           "v": n * r.kv_heads * d * e, "attention output": n * r.heads * d * e, "lse": n * r.heads * FP32,
           "mlp_norm (x, rstd, y)": norm, "gate g": f, "up u": f, "silu(g)·u": f}
    extra = context_attention_saved_bytes(context, n, r.heads, d, e, recompute, r.kv_heads, str(context_mode))
    return {**out, "o_proj input (C > 1 copy)": extra} if extra else out


def layer_saved_bytes(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                      e: int = FP32, context: int = 1) -> int:
    """Bytes one decoder layer keeps for backward, activations only (module docstring §2; the
    weight copies of autocast are :func:`weight_copy_bytes`): the sum of :func:`layer_saved_tensors`."""
    return sum(layer_saved_tensors(cfg, mode, T, sequence_parallel, tokens, recompute, e, context).values())


def weight_copy_bytes(cfg, mode: str, T: int, layers: int, has_head: bool, recompute: str = "none",
                      e: int = FP32, param_bytes: int = FP32) -> int:
    """Autocast's e-byte copies of the weights that autograd keeps (module docstring §2, "weight
    copies"): 0 when parameters are already e-byte; else the weights multiplied through
    ``F.linear``/SUMMA (none and 2D: all; 1D: the row layers o_proj and down_proj), per decoder
    layer unless ``full`` recompute, and the head's on the last stage (none, 2D)."""
    if e >= param_bytes:
        return 0
    per_layer, head = TensorMode.parse(mode).autocast_weight_elements(cfg, T)
    return e * ((0 if recompute == "full" else per_layer * layers) + (head if has_head else 0))


def embedding_saved_bytes(mode: str, T: int, tokens: int) -> int:
    """Token ids (N·8), plus the out-of-range mask (N·1) when the table is split."""
    return TensorMode.parse(mode).embedding_saved_bytes(T, tokens)


def head_and_loss_saved_bytes(cfg, mode: str, T: int, tokens: int, e: int = FP32) -> int:
    """The fp32 (log-)softmax over this rank's logits block and the loss's targets/masks (any precision:
    the loss upcasts the logits); at 3D with a tied head also :func:`gridshard.tensor.tp3d.scheme.tied_head_saved_bytes` (the scheme's ``head_and_loss_saved_bytes``)."""
    return TensorMode.parse(mode).head_and_loss_saved_bytes(cfg, T, _rank_shape(cfg, mode, T, False, tokens), e)


def document_mask_bytes(cfg, token_rows: int, seq_len: int, context: int, context_mode: str, layers: int,
                        e: int) -> int:
    """What a micro-batch of packed windows (``data.document_mask``) adds on one rank whose attention
    reads N_r = ``token_rows`` tokens, s_r = S/C per sequence (m_r = N_r/s_r sequences;
    :func:`gridshard.nn.documents.document_inputs`): the rotary tables at each token's position,
    2·N_r·d·e (kept by every layer's RoPE, once: the model's shared [S, d] tables are then not what
    the layers keep), plus the additive mask, held until the micro-batch's backward: on the whole
    sequence (C = 1) one m_r·S²·e mask shared by the layers (saved by SDPA, or held by the recompute's
    inputs); under all-to-all each layer's own over the whole sequence, ``layers``·m_r·S²·e (the
    sequences are whole after the trade, m_r·S²·e each); the ring's block masks live only while
    their block computes."""
    if not token_rows:
        return 0
    m, S = token_rows // (seq_len // context), seq_len
    tables = 2 * token_rows * cfg.head_dim * e
    if context == 1:
        return tables + m * S * S * e
    return tables + (layers * m * S * S * e if context_mode == "all_to_all" else 0)


def activation_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", layers: Optional[int] = None,
                     has_embedding: bool = True, has_head: bool = True, precision: str = "fp32",
                     param_bytes: int = FP32, context: int = 1, moe_layers: Optional[int] = None,
                     expert: int = 1, context_mode: str = "ring", documents: bool = False) -> ActivationBytes:
    """Activation bytes one micro-batch keeps on one rank (module docstring §2).

    ``micro_batch``: sequences of the tensor group's micro-batch (2D splits them over grid
    rows here); ``layers``: decoder layers on this rank (default all); ``has_embedding`` /
    ``has_head``: first / last pipeline stage; ``precision``: ``train.precision`` (activations
    in its compute dtype, e = 4 or 2); ``param_bytes``: bytes of a stored parameter element
    (4: fp32 parameters, which autocast copies to e bytes); ``context``: C, the context ranks
    ``seq_len`` is split over — every per-token tensor, the RoPE tables included, holds the rank's
    b·S/C tokens, plus the C > 1 attention term
    (:func:`gridshard.theory.context.context_attention_saved_bytes`). An MoE model (``cfg.experts``):
    ``moe_layers`` of the rank's layers are MoE (default: those of all ``cfg.layers``), each keeping
    :func:`gridshard.theory.moe.moe_layer_saved_tensors` (``expert``: E). ``documents``: packed windows with
    document masks (:func:`document_mask_bytes`). A Vision Transformer's config
    (``micro_batch`` images; ``seq_len`` unused): :func:`gridshard.theory.memory.vision.vit_activation_terms`."""
    e = activation_element_bytes(precision)
    if is_vision(cfg):                           # a ViT: its own layers (gridshard.theory.memory.vision)
        L = cfg.layers if layers is None else layers
        return ActivationBytes(layers=L, rope_tables=0,
                               weight_copies=weight_copy_bytes(cfg, mode, T, L, False, recompute, e, param_bytes),
                               **vit_activation_terms(cfg, micro_batch, mode, T, sequence_parallel, recompute,
                                                      has_embedding, has_head, e, param_bytes))
    s_r = seq_len // context                     # the rank's 2c tokens of every sequence
    N = micro_batch * s_r
    sp = TensorMode.parse(mode).sequence_parallel_in_effect(sequence_parallel, T)
    L = cfg.layers if layers is None else layers
    dense = layer_saved_tensors(cfg, mode, T, sp, N, recompute, e, context, context_mode)
    moe = getattr(cfg, "experts", 0) and (sum(map(cfg.is_moe_layer, range(L))) if moe_layers is None else moe_layers)
    per_moe = sum(moe_layer_saved_tensors(cfg, dense, _rank_shape(cfg, mode, T, sp, N).residual, N, micro_batch,
                                          recompute, e, param_bytes, expert).values()) if moe else 0
    return ActivationBytes(
        per_layer=sum(dense.values()),
        layers=L, moe_layers=moe or 0, per_moe_layer=per_moe,
        rope_tables=2 * s_r * cfg.head_dim * e if L and not documents else 0,
        documents=document_mask_bytes(cfg, _rank_shape(cfg, mode, T, False, N).token_rows, seq_len, context,
                                      str(context_mode), L, e) if L and documents else 0,
        embedding=embedding_saved_bytes(mode, T, N) if has_embedding else 0,
        final_norm=norm_saved_bytes(cfg, mode, T, sp, N, e) if has_head else 0,
        head_and_loss=head_and_loss_saved_bytes(cfg, mode, T, N, e) if has_head else 0,
        weight_copies=weight_copy_bytes(cfg, mode, T, L, has_head, recompute, e, param_bytes),
    )


def logits_workspace_bytes(cfg, micro_batch: int, seq_len: int, mode: str = "none", T: int = 1,
                           precision: str = "fp32") -> int:
    """The logits block (e bytes) and its fp32 upcast / gradient, alive around the loss but not
    saved: N_r·V_r·(e + 4) (2·N_r·V_r·4 in fp32); a ViT's: :func:`gridshard.theory.memory.vision.vit_logits_workspace_bytes`."""
    if is_vision(cfg):
        return vit_logits_workspace_bytes(cfg, micro_batch, mode, T, activation_element_bytes(precision))
    r = _rank_shape(cfg, mode, T, False, micro_batch * seq_len)
    return r.token_rows * r.vocab_block * (activation_element_bytes(precision) + FP32)
