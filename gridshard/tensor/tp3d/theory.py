"""3D tensor parallelism on a q×q×q cube (T = q³): bytes moved and stored per rank.

Notation: cube side q, N = b·s tokens, e bytes per element, payloads in the ledger's convention
(all-gather: the gathered output; reduce-scatter: the unscattered input; all-reduce: the tensor).
Volumes come per *physical* ledger axis (:mod:`gridshard.tensor.tp3d.mesh`): ``"weight"``,
``"input"``, ``"output"`` (q ranks each) and the flattened ``"weight_input"``,
``"weight_output"`` (q² ranks each). A layer built on the swapped orientation
(``swapped=True``) runs its ``input`` role on the physical ``output`` axis and vice versa, and
its ``batch`` role on ``weight_output`` instead of ``weight_input``; every function takes the
orientation of the mesh the layer was built on.

Linear (in → out), forward + backward (:mod:`gridshard.tensor.tp3d.matmul`):

=========  ====================================================  =====================================
role       forward                                               backward
=========  ====================================================  =====================================
input      all-gather X_il: N·in/q²·e                            all-gather X_il again (for dW),
                                                                 reduce-scatter dX_il (if dX): N·in/q²·e
weight     all-gather W_lj: in·out/q²·e                          all-gather W_lj (if dX), reduce-scatter
                                                                 dW_lj: in·out/q²·e each
output     reduce-scatter P_ijl: N·out/q²·e                      all-gather dY_ij: N·out/q²·e
batch'     bias all-gather out/q·e (``vector_gathers``)          bias reduce-scatter out/q·e
=========  ====================================================  =====================================

(batch' = the *output* layout's batch axis: the bias is a vector of the swapped layout.) So
8 calls (10 with bias), ring wire bytes per rank (q − 1)/q³·(3·N·in + 2·N·out + 3·in·out)·e,
the published O(6(q − 1)/q³) bandwidth in units of the per-rank blocks (the three blocks
N·in/q³, N·out/q³ and in·out/q³, each moved about twice), against 2D's 3(q' − 1)/q'²·(N·in + in·out)·e.
Parameters per rank (in·out + out)/q³; saved input N·in/q³ (both 1/T of one device's).

Norms (hidden h on the layer's ``output`` role, vectors on its ``batch`` role): RMSNorm two
all-reduces of N/q² fp32 statistics; LayerNorm three (N/q², N/q², 2·N/q² elements, x's dtype);
each vector one all-gather and one reduce-scatter of h/q·e. Embedding (vocab over ``batch``):
token all-gather b·s·8 bytes, output reduce-scatter and gradient all-gather b·s·h/q·e each, all
on ``batch``. Cross-entropy (fp32 logits): two all-reduces on the logits' ``output`` role
(N/q² and 2·N/q² fp32) and one of (2 + 2q²)·8 bytes on their ``batch`` role.
"""
from __future__ import annotations

from ...theory import CommVolume, axes_rounds, axes_wire_bytes, combine_axes
from ...theory.vocab import padded_vocab_size

AXES = ("weight", "input", "output", "weight_input", "weight_output")


def _zero(q: int) -> dict:
    return {a: CommVolume(q * q if "_" in a else q) for a in AXES}


def roles(swapped: bool) -> dict:
    """Role → physical axis name for a layer built on the plain (False) or swapped (True) mesh."""
    if swapped:
        return {"weight": "weight", "input": "output", "output": "input", "batch": "weight_output"}
    return {"weight": "weight", "input": "input", "output": "output", "batch": "weight_input"}


# per-axis sums, calls and ring bytes: one home in gridshard.theory
combine, rounds, wire_bytes = combine_axes, axes_rounds, axes_wire_bytes


def _blocks(q: int, **sizes) -> None:
    for name, (value, div) in sizes.items():
        if value % div:
            raise ValueError(f"{name}={value} is not divisible by {div} (3D blocks of a q={q} cube)")


def linear3d_comm(tokens: int, in_features: int, out_features: int, q: int, bytes_per_elem: int = 4,
                  bias: bool = False, input_grad: bool = True, swapped: bool = False,
                  vector_gathers: int = 1) -> dict:
    """Linear3D forward + backward over ``tokens`` = N (module docstring's table)."""
    _blocks(q, tokens=(tokens, q * q), in_features=(in_features, q * q), out_features=(out_features, q))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    x, w, y = tokens * in_features // q ** 2 * e, in_features * out_features // q ** 2 * e, \
        tokens * out_features // q ** 2 * e
    v[r["input"]].add("all_gather", x, 2).add("reduce_scatter", x, int(input_grad))
    v[r["weight"]].add("all_gather", w, 1 + int(input_grad)).add("reduce_scatter", w)
    v[r["output"]].add("reduce_scatter", y).add("all_gather", y)
    if bias:
        out_batch = roles(not swapped)["batch"]
        v[out_batch].add("all_gather", out_features // q * e, vector_gathers).add("reduce_scatter",
                                                                                    out_features // q * e)
    return v


def _vectors(v: dict, batch_axis: str, hidden: int, q: int, e: int, count: int, vector_gathers: int) -> dict:
    v[batch_axis].add("all_gather", hidden // q * e, count * vector_gathers).add("reduce_scatter", hidden // q * e,
                                                                                 count)
    return v


def rmsnorm3d_comm(tokens: int, hidden: int, q: int, bytes_per_elem: int = 4, swapped: bool = False,
                   vector_gathers: int = 1) -> dict:
    """RMSNorm3D forward + backward: Σx² and Σ(g·w·x) all-reduced on ``output`` (N/q² fp32 each),
    the weight gathered / reduce-scattered on ``batch`` (h/q·e)."""
    _blocks(q, tokens=(tokens, q * q), hidden=(hidden, q ** 3))
    r, v = roles(swapped), _zero(q)
    v[r["output"]].add("all_reduce", tokens // q ** 2 * 4, 2)
    return _vectors(v, r["batch"], hidden, q, bytes_per_elem, 1, vector_gathers)


def layernorm3d_comm(tokens: int, hidden: int, q: int, bytes_per_elem: int = 4, swapped: bool = False,
                     vector_gathers: int = 1) -> dict:
    """LayerNorm3D forward + backward: Σx, Σ(x−μ)² ([N/q²] each) and the two backward means
    ([N/q², 2]) all-reduced on ``output`` in fp32 whatever e (the 2D norm's function,
    :mod:`gridshard.tensor.tp2d.norm`); weight and bias on ``batch`` in e."""
    _blocks(q, tokens=(tokens, q * q), hidden=(hidden, q ** 3))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    v[r["output"]].add("all_reduce", tokens // q ** 2 * 4, 2).add("all_reduce", 2 * tokens // q ** 2 * 4)
    return _vectors(v, r["batch"], hidden, q, e, 2, vector_gathers)


def embedding3d_comm(batch: int, seq: int, hidden: int, q: int, bytes_per_elem: int = 4, swapped: bool = False,
                     token_bytes: int = 8) -> dict:
    """VocabParallelEmbedding3D forward + backward, all on ``batch``: token all-gather (b·s·8
    bytes), output reduce-scatter and gradient all-gather of b·s·h/q·e each."""
    _blocks(q, batch=(batch, q * q), hidden=(hidden, q))
    v = _zero(q)
    a = batch * seq * hidden // q * bytes_per_elem
    v[roles(swapped)["batch"]].add("all_gather", batch * seq * token_bytes).add("reduce_scatter", a) \
        .add("all_gather", a)
    return v


def head3d_comm(tokens: int, hidden: int, vocab: int, q: int, bytes_per_elem: int = 4, swapped: bool = False) -> dict:
    """VocabParallelClassifier3D (h → V_pad = ⌈V/q⌉·q, no bias): a Linear3D's volume."""
    return linear3d_comm(tokens, hidden, padded_vocab_size(vocab, q), q, bytes_per_elem, swapped=swapped)


def cross_entropy3d_comm(tokens: int, q: int, swapped: bool = False) -> dict:
    """cross_entropy_3d forward (fp32 logits) on logits in the ``swapped`` orientation: max and
    (Σexp, z_t) all-reduced on ``output`` (N/q²·4 and 2·N/q²·4 bytes), (loss sum, count, 2q²
    verdict slots) float64 on ``batch``."""
    _blocks(q, tokens=(tokens, q * q))
    r, v = roles(swapped), _zero(q)
    v[r["output"]].add("all_reduce", tokens // q ** 2 * 4).add("all_reduce", 2 * tokens // q ** 2 * 4)
    v[r["batch"]].add("all_reduce", (2 + 2 * q * q) * 8)
    return v


def linear3d_param_bytes(in_features: int, out_features: int, q: int, bytes_per_elem: int = 4,
                         bias: bool = False) -> int:
    """(in·out + out)/q³ elements per rank: 1/T of the layer."""
    return (in_features * out_features + (out_features if bias else 0)) // q ** 3 * bytes_per_elem


def linear3d_saved_activation_bytes(tokens: int, in_features: int, q: int, bytes_per_elem: int = 4) -> int:
    """Saved for backward per rank: the input block N·in/q³ elements (1/T of one device's; the
    gathered X_il and W_lj are not kept but gathered again in backward)."""
    return tokens * in_features // q ** 3 * bytes_per_elem


def linear3d_wire_bytes(tokens: int, in_features: int, out_features: int, q: int, bytes_per_elem: int = 4) -> float:
    """Closed form of ``wire_bytes(linear3d_comm(...))`` without bias:
    (q − 1)/q³·(3·N·in + 2·N·out + 3·in·out)·e."""
    n, i, o = tokens, in_features, out_features
    return (q - 1) / q ** 3 * (3 * n * i + 2 * n * o + 3 * i * o) * bytes_per_elem


__all__ = ["AXES", "roles", "combine", "rounds", "wire_bytes", "linear3d_comm", "rmsnorm3d_comm",
           "layernorm3d_comm", "embedding3d_comm", "head3d_comm", "cross_entropy3d_comm", "linear3d_param_bytes",
           "linear3d_saved_activation_bytes", "linear3d_wire_bytes"]


# ---------------------------------------------------------------------------------------
# decoder block, whole model, cube groups (issue 24: the planner prices a 3D layout from these)
# ---------------------------------------------------------------------------------------
def linear3d_forward_comm(tokens: int, in_features: int, out_features: int, q: int, bytes_per_elem: int = 4,
                          swapped: bool = False) -> dict:
    """The forward half of :func:`linear3d_comm` (no bias): X all-gathered on ``input``
    (N·in/q²·e), W on ``weight`` (in·out/q²·e), the product reduce-scattered on ``output``
    (N·out/q²·e) — what ``recompute: full`` runs again."""
    _blocks(q, tokens=(tokens, q * q), in_features=(in_features, q * q), out_features=(out_features, q))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    v[r["input"]].add("all_gather", tokens * in_features // q ** 2 * e)
    v[r["weight"]].add("all_gather", in_features * out_features // q ** 2 * e)
    v[r["output"]].add("reduce_scatter", tokens * out_features // q ** 2 * e)
    return v


def _kv_width(hidden: int, heads, kv_heads) -> int:
    """K·d (d = h/H): the width of k_proj and v_proj; h for multi-head attention."""
    if heads is None or kv_heads is None:
        return hidden
    return kv_heads * (hidden // heads)


def block3d_comm(batch: int, seq: int, hidden: int, ffn: int, q: int, bytes_per_elem: int = 4,
                 heads: int | None = None, kv_heads: int | None = None) -> dict:
    """One Llama decoder block forward + backward on the cube, N = b·s tokens of the tensor group's
    micro-batch. The layers as ``parallelize`` lays them out at 3D: RMSNorm3D (residual
    orientation) → q_proj h→h, k_proj and v_proj h→K·d on the residual orientation, computed as one
    product of the joined weight blocks (their outputs land in the swapped one: batch block i·q + l,
    heads block j; :func:`gridshard.tensor.tp3d.matmul.matmul_3d_parts`) → the attention core, local
    on H/q heads and K/q kv heads → o_proj h→h on the swapped orientation (back to the residual
    layout); RMSNorm3D → gate_proj and up_proj h→f as one product (residual orientation) →
    down_proj f→h (swapped). So the norm output is gathered once per joined product, the minimum:
    q|k|v moves what one Linear3D h → h + 2·K·d moves, gate|up one h → 2f. Per axis (q ranks on
    ``weight``/``input``/``output``)::

        input + output (the two activation axes, one product each way):
            Σ_products 3·N·in/q²·e + 2·N·out/q²·e            (8 calls per product, 4 products)
        weight:  Σ_products 3·in·out/q²·e
        output (residual norms): 2 × two all-reduces of N/q² fp32; batch: 2 × (h/q·e gather + scatter)

    Against separate products (8 calls each, 7 in all) the joined ones save 2·N·h/q²·e per extra
    part on each of ``input``'s three calls: 3·(2 + 1)·N·h/q²·e per block, 24 calls fewer."""
    n, e = batch * seq, bytes_per_elem
    kv = _kv_width(hidden, heads, kv_heads)
    norm = rmsnorm3d_comm(n, hidden, q, e)
    return combine(norm, linear3d_comm(n, hidden, hidden + 2 * kv, q, e),
                   linear3d_comm(n, hidden, hidden, q, e, swapped=True),
                   norm, linear3d_comm(n, hidden, 2 * ffn, q, e), linear3d_comm(n, ffn, hidden, q, e, swapped=True))


def block3d_recompute_comm(batch: int, seq: int, hidden: int, ffn: int, q: int, bytes_per_elem: int = 4,
                           heads: int | None = None, kv_heads: int | None = None) -> dict:
    """What ``recompute: full`` repeats per 3D decoder block (the 1D/2D rule): the forward
    products of q|k|v (joined), o and gate|up (joined) (:func:`linear3d_forward_comm`; the down
    projection's input is the last tensor backward needs) and the two norms' forward: one
    all-reduce of N/q² fp32 statistics on ``output`` and the weight's gather h/q·e on ``batch`` each."""
    n, e = batch * seq, bytes_per_elem
    kv = _kv_width(hidden, heads, kv_heads)
    norm = _zero(q)
    norm["output"].add("all_reduce", n // q ** 2 * 4)
    norm["weight_input"].add("all_gather", hidden // q * e)
    fwd = lambda i, o, sw=False: linear3d_forward_comm(n, i, o, q, e, swapped=sw)  # noqa: E731
    return combine(norm, fwd(hidden, hidden + 2 * kv), fwd(hidden, hidden, True), norm, fwd(hidden, 2 * ffn))


def tied_head3d_comm(tokens: int, hidden: int, vocab: int, q: int, bytes_per_elem: int = 4) -> dict:
    """TiedVocabHead3D (:mod:`gridshard.tensor.tp3d.tied_head`): the embedding's table blocks all-gathered
    over the residual orientation's ``batch`` axis to the hidden block [V_pad, h/q] (V_pad = ⌈V/q²⌉·q²,
    the embedding's padding) and reduce-scattered back in backward (V_pad·h/q·e each), then the 3D
    product h → V_pad on the kept slice with a Linear3D's eight calls."""
    vp, e = padded_vocab_size(vocab, q * q), bytes_per_elem
    v = linear3d_comm(tokens, hidden, vp, q, e)
    v[roles(False)["batch"]].add("all_gather", vp * hidden // q * e).add("reduce_scatter", vp * hidden // q * e)
    return v


def ends3d_comm(batch: int, seq: int, hidden: int, vocab: int, q: int, bytes_per_elem: int = 4,
                first: bool = True, last: bool = True, tied: bool = False) -> dict:
    """The model's ends on the cube: the embedding (first stage; :func:`embedding3d_comm`) and the
    final RMSNorm3D, the head h → V_pad = ⌈V/q⌉·q on the residual orientation (a Linear3D,
    :func:`head3d_comm`; ``tied``: :func:`tied_head3d_comm`, on a rank holding both ends) and the loss
    on its swapped logits (:func:`cross_entropy3d_comm`) (last stage)."""
    n, e = batch * seq, bytes_per_elem
    parts = [_zero(q)]
    if first:
        parts.append(embedding3d_comm(batch, seq, hidden, q, e))
    if last:
        head = tied_head3d_comm(n, hidden, vocab, q, e) if tied and first else head3d_comm(n, hidden, vocab, q, e)
        parts += [rmsnorm3d_comm(n, hidden, q, e), head, cross_entropy3d_comm(n, q, swapped=True)]
    return combine(*parts)


def block3d_param_bytes(hidden: int, ffn: int, q: int, bytes_per_elem: int = 4, heads: int | None = None,
                        kv_heads: int | None = None) -> int:
    """((2h + 2·K·d)·h + 3·h·f + 2h)/q³ elements per rank: every weight and norm vector 1/T."""
    kv = _kv_width(hidden, heads, kv_heads)
    return ((2 * hidden + 2 * kv) * hidden + 3 * hidden * ffn + 2 * hidden) // q ** 3 * bytes_per_elem


def axis_groups(q: int) -> dict:
    """Axis name → its groups, each a tuple of tensor ranks t = (i·q + j)·q + l (i weight, j input,
    l output: :mod:`gridshard.tensor.tp3d.mesh`). ``output`` groups are q consecutive ranks, ``input``
    groups stride q within a block of q², ``weight`` stride q²; ``weight_input`` (l fixed) and
    ``weight_output`` (j fixed) span the whole cube. Which groups cross a node boundary follows."""
    t = lambda i, j, l: (i * q + j) * q + l  # noqa: E731
    r = range(q)
    return {"output": [tuple(t(i, j, l) for l in r) for i in r for j in r],
            "input": [tuple(t(i, j, l) for j in r) for i in r for l in r],
            "weight": [tuple(t(i, j, l) for i in r) for j in r for l in r],
            "weight_input": [tuple(t(i, j, l) for i in r for j in r) for l in r],
            "weight_output": [tuple(t(i, j, l) for i in r for l in r) for j in r]}


__all__ += ["linear3d_forward_comm", "block3d_comm", "block3d_recompute_comm", "tied_head3d_comm", "ends3d_comm",
            "block3d_param_bytes", "axis_groups"]


# ---------------------------------------------------------------------------------------
# the ViT path on the cube: patch embedding, classifier, classification loss (gridshard.tensor.tp3d.vision)
# ---------------------------------------------------------------------------------------
def patch_embedding3d_comm(batch: int, hidden: int, channels: int, patch: int, seq: int, q: int,
                           bytes_per_elem: int = 4, swapped: bool = False, image_grad: bool = False) -> dict:
    """PatchEmbedding3D forward + backward, all but the image gradient on the layer's ``batch`` role
    (q² ranks): the kernel [h, C, P, P], bias, class token and positions [s, h] all-gathered to
    hidden block l and their gradients reduce-scattered, 4 calls each way of (K + 2 + s)·h/q·e
    bytes in all (K = C·P², s = 1 + n): independent of the batch; no activation moves. With
    ``image_grad`` (images that require a gradient) one all-reduce on ``output`` of the image
    block, b/q²·C·H·W·e = b/q²·K·(s − 1)·e."""
    _blocks(q, batch=(batch, q * q), hidden=(hidden, q ** 3))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    k = channels * patch * patch
    for size in (k, 1, 1, seq):                    # kernel, bias, class token, positions: size·h/q·e each
        v[r["batch"]].add("all_gather", size * hidden // q * e).add("reduce_scatter", size * hidden // q * e)
    if image_grad:
        v[r["output"]].add("all_reduce", batch // q ** 2 * k * (seq - 1) * e)
    return v


def classifier3d_comm(rows: int, hidden: int, classes: int, q: int, bytes_per_elem: int = 4, bias: bool = True,
                      swapped: bool = False) -> dict:
    """Classifier3D / ClsClassifier3D forward + backward over ``rows`` inputs (b images for the class
    token head): the weight [K, h] all-gathered on ``batch`` to [K, h/q] and its gradient
    reduce-scattered (K·h/q·e each); the partial logits all-reduced on ``output`` (rows/q²·K·e,
    forward only: the dual is identity); the replicated bias's gradient all-reduced on ``batch``
    (K·e)."""
    _blocks(q, rows=(rows, q * q), hidden=(hidden, q ** 3))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    v[r["batch"]].add("all_gather", classes * hidden // q * e).add("reduce_scatter", classes * hidden // q * e)
    v[r["output"]].add("all_reduce", rows // q ** 2 * classes * e)
    if bias:
        v[r["batch"]].add("all_reduce", classes * e)
    return v


def classification_loss3d_comm(q: int, reduction: str = "mean", swapped: bool = False) -> dict:
    """classification_loss_3d on the classifier's orientation: the fp32 loss sum all-reduced on
    ``batch`` (4 bytes; backward identity) and, for ``"mean"``, the valid count (float64, 8 bytes)."""
    r, v = roles(swapped), _zero(q)
    v[r["batch"]].add("all_reduce", 4)
    if reduction == "mean":
        v[r["batch"]].add("all_reduce", 8)
    return v


def patch_embedding3d_param_bytes(hidden: int, channels: int, patch: int, seq: int, q: int,
                                  bytes_per_elem: int = 4) -> int:
    """(C·P² + 2 + s)·h/q³ elements per rank: 1/T of the layer (kernel, bias, class token, positions)."""
    return (channels * patch * patch + 2 + seq) * hidden // q ** 3 * bytes_per_elem


__all__ += ["patch_embedding3d_comm", "classifier3d_comm", "classification_loss3d_comm",
            "patch_embedding3d_param_bytes"]
