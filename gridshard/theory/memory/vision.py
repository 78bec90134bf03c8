"""Memory per rank, §2 for a Vision Transformer: the activations its forward keeps for backward.

Notation: see :mod:`gridshard.theory.memory`; the ViT: :mod:`gridshard.models.vit` (b images of
C×H×H, patches P×P, s = 1 + (H/P)² tokens, N = b·s, h, H_a heads of d, f, K classes). e: bytes of
an activation element (4 fp32, 2 bf16/fp16); pb: bytes of a stored parameter element (4, or 2 under
``train.precision: bf16``). N_r, R, H_r, f_r: the mode's rank shape (:meth:`gridshard.tensor.base.Scheme.rank_shape`);
b_r = N_r/s the rank's images (b/q in 2D, b/q² in 3D). Derived op by op from the tensors autograd
saves, as §2 does for the decoder; the mode-specific terms are the schemes' answers
(``layer_norm_saved_bytes``, ``image_embedding_saved_bytes``, ``class_head_saved_bytes``).

Per encoder layer, recompute ``none``::

    2·LN + 3·N_r·H_r·d·e (q, k, v) + N_r·H_r·4 (log-sum-exp) + N_r·H_r·d·e (attention output)
         + 2·N_r·f_r·e (u, gelu(u))  [+ N_r·H_r·d·e under 1D + SP: o_proj's sequence-first copy]
    LN = x + statistics + y:  R·e + 2·(R/h)·pb + R·e           none, 1D, 1D + SP (y the block)
                              R·e + N_r·4 + h/q·pb + R·e       2D (x̂, fp32 rstd, gathered w, SUMMA's y)
                              R·e + N_r·4 + h/q·pb + R·max(e, pb)   3D (y as the norm returns it)

``selective`` (the attention core and GELU in checkpoints): the same less the log-sum-exp (the
core's output is recomputed and kept by o_proj; under SP only o_proj's sequence-first copy of it;
GELU keeps u and output.dense gelu(u) either way).
``full``: the layer input R·e. Autocast's weight copies of the layers (e < pb, not under ``full``)
are held once per rank: the scheme's ``autocast_weight_elements`` with two MLP matrices
(none: 4h² + 2hf per layer; 1D: the row layers, h·(H_r·d + f_r); 2D: (4h² + 2hf)/q²; 3D: none).

Outside the layers: the patch embedding keeps the images and the kernel copy (first stage); the
final LayerNorm keeps x and its statistics, its output is kept by the classifier through the class
row (a view, R·e; a copy where the row is gathered or cast), with the classifier's weight copy and
the loss b_r·K·4 + b·8 + 4 (last stage). No RoPE tables. The logits workspace is b_r·K·(e + 4).

Asserted against the saved-tensor meter to the byte (``tests/test_memory_vit.py``): none, 1D,
1D + SP, 2D (and 3D, wide), every recompute mode, in fp32, under bf16 autocast over fp32
parameters and with bf16 parameters. Measured on CPU; CUDA's autocast runs ``layer_norm`` in fp32
(an fp32 copy of x and an fp32 y per norm, not measured here).
"""
from __future__ import annotations

from ...job_layout import TensorMode
from .model_state import FP32


def is_vision(cfg) -> bool:
    """Whether ``cfg`` describes a Vision Transformer (:class:`gridshard.models.vit.ViTConfig`)."""
    return getattr(cfg, "family", "decoder") == "vit"


def vit_layer_saved_tensors(cfg, mode: str, T: int, sequence_parallel: bool, tokens: int, recompute: str = "none",
                            e: int = FP32, param_bytes: int = FP32) -> dict:
    """What one encoder layer keeps for backward, tensor by tensor (module docstring): name → bytes."""
    scheme = TensorMode.parse(mode)
    r = scheme.rank_shape(cfg, T, sequence_parallel, tokens)
    if recompute == "full":
        return {"input": r.residual * e}
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    n = r.token_rows
    heads, mlp = n * r.heads * cfg.head_dim * e, n * r.ffn * e
    norm = scheme.layer_norm_saved_bytes(cfg, T, r, e, param_bytes, True)
    out = {"layernorm_before (x, statistics, y)": norm, "q": heads, "k": heads, "v": heads,
           "lse": n * r.heads * FP32, "attention output": heads, "layernorm_after (x, statistics, y)": norm,
           "u": mlp, "gelu(u)": mlp}
    if recompute == "selective":
        del out["lse"]
    if recompute == "none" and scheme.sequence_parallel_in_effect(sequence_parallel, T):  # o_proj's sequence-first copy
        out["attention output (sequence-first copy)"] = heads
    return out


def vit_activation_terms(cfg, micro_batch: int, mode: str = "none", T: int = 1, sequence_parallel: bool = False,
                         recompute: str = "none", has_embedding: bool = True, has_head: bool = True, e: int = FP32,
                         param_bytes: int = FP32) -> dict:
    """One micro-batch of ``micro_batch`` images on one rank (module docstring): the
    :class:`gridshard.theory.memory.ActivationBytes` fields ``per_layer``, ``embedding``, ``final_norm``
    and ``head_and_loss``, which :func:`gridshard.theory.memory.activation_bytes` completes (layers,
    autocast's weight copies; no RoPE tables)."""
    scheme = TensorMode.parse(mode)
    sp = scheme.sequence_parallel_in_effect(sequence_parallel, T)
    N = micro_batch * cfg.seq_len
    r = scheme.rank_shape(cfg, T, sp, N)
    return {"per_layer": sum(vit_layer_saved_tensors(cfg, mode, T, sp, N, recompute, e, param_bytes).values()),
            "embedding": scheme.image_embedding_saved_bytes(cfg, T, micro_batch, e, param_bytes) if has_embedding else 0,
            "final_norm": scheme.layer_norm_saved_bytes(cfg, T, r, e, param_bytes, False) if has_head else 0,
            "head_and_loss": scheme.class_head_saved_bytes(cfg, T, r, micro_batch, e, param_bytes, sp)
            if has_head else 0}


def vit_logits_workspace_bytes(cfg, micro_batch: int, mode: str, T: int, e: int) -> int:
    """The classifier's logits (e bytes) and their fp32 upcast around the loss: b_r·K·(e + 4)."""
    rows = micro_batch // TensorMode.parse(mode).batch_split(T)
    return rows * cfg.num_classes * (e + FP32)
