"""3D tensor parallelism on a q×q×q cube (T = q³): bytes moved and stored per rank.

Notation: cube side q, N = b·s tokens, e bytes per element, payloads in the ledger's convention
(all-gather: the gathered output; reduce-scatter: the unscattered input; all-reduce: the tensor).
Volumes come per *physical* ledger axis (:mod:`gridshard.comm.mesh_3d`): ``"weight"``,
``"input"``, ``"output"`` (q ranks each) and the flattened ``"weight_input"``,
``"weight_output"`` (q² ranks each). A layer built on the swapped orientation
(``swapped=True``) runs its ``input`` role on the physical ``output`` axis and vice versa, and
its ``batch`` role on ``weight_output`` instead of ``weight_input``; every function takes the
orientation of the mesh the layer was built on.

Linear (in → out), forward + backward (:mod:`gridshard.comm.matmul_3d`):

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

from . import CommVolume, axes_rounds, axes_wire_bytes, combine_axes
from .vocab import padded_vocab_size

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
    ([N/q², 2]) all-reduced on ``output`` in x's dtype; weight and bias on ``batch``."""
    _blocks(q, tokens=(tokens, q * q), hidden=(hidden, q ** 3))
    e, r, v = bytes_per_elem, roles(swapped), _zero(q)
    v[r["output"]].add("all_reduce", tokens // q ** 2 * e, 2).add("all_reduce", 2 * tokens // q ** 2 * e)
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
