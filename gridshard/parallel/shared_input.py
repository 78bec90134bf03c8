"""One input, several column projections: one collective and one matmul.

Attention reads its input x through q, k and v; the MLP through gate and up. Laid out as
separate column layers, each would prepare x on its own — 1D: three ``copy_to_group``
(three all-reduces of ∂L/∂x in backward) or three sequence all-gathers; 2D: three SUMMA
products, each broadcasting x's panels along the grid rows. A fused weight avoids that
but breaks the canonical layout (its rank blocks interleave the parts).

So the projections keep separate parameters and the parent module gets a forward
pre-hook that, for its input x,

Each mode's product is its scheme's (``shared_input_fusion``: ``gridshard/tensor/tp1d/fused_input.py``;
2D and 3D share :func:`gridshard.tensor.grid_linear.shared_input_fusion`):

* 1D: prepares x once (the sequence all-gather under sequence parallelism, else
  ``copy_to_group``) and computes ``x · [W_q; W_k; W_v]_tᵀ`` on the concatenated local
  blocks (+ the concatenated biases); under SP that one product keeps only the rank's
  sequence block for backward and re-gathers it there (:mod:`gridshard.tensor.tp1d.input_grad_overlap`),
  so the gathered x replacing the parent's input lives only through the parent's forward;
* 2D: computes one SUMMA A·B with B = [W_q | W_k | W_v] (the local [in/q, n/q] blocks
  side by side: column j of the grid holds block j of every part, so the product's
  block j is [q block j | k block j | v block j]) and adds each part's gathered bias;
* 3D: computes one cube product X·[A_q | A_k | A_v] of the joined local blocks
  (:func:`gridshard.tensor.tp3d.matmul.matmul_3d_parts`: X gathered over ``input`` once, the
  joined weight over ``weight`` in one call, one reduce-scatter of the product) and adds each
  part's gathered bias;

then splits the result into the children's output blocks (made contiguous: models
``view`` them into heads; under SP contiguous in the sequence-first order of the gathered x)
and leaves each child its slice in the child's ``precomputed`` slot
(:mod:`gridshard.nn.precomputed`). Communication per forward+backward is therefore
that of one layer of width Σ out: the old fused-weight figures of
:mod:`gridshard.tensor.tp1d.theory` / :mod:`gridshard.tensor.tp2d.theory`, and
:func:`gridshard.tensor.tp3d.theory.block3d_comm`'s products of the joined widths. If the parent calls a child
with another tensor than its own input, the child just computes on its own (correct,
only without the saving).
"""
from __future__ import annotations

import torch

_INPUT_NAMES = ("hidden_states", "x", "input")


def replace_input(args, kwargs, new):
    """A forward pre-hook's (args, kwargs) with the module's first input (:func:`first_input`) replaced by ``new``."""
    if args:
        return (new, *args[1:]), kwargs
    for key in _INPUT_NAMES:
        if key in kwargs:
            return args, {**kwargs, key: new}
    return args, kwargs


def first_input(args, kwargs):
    """A module call's first input: the first positional argument, else the first of ``hidden_states``, ``x``,
    ``input`` passed by keyword (None if none is)."""
    if args:
        return args[0]
    for key in _INPUT_NAMES:
        if key in kwargs:
            return kwargs[key]
    return None


def install_shared_input(parent: torch.nn.Module, child_names, mode) -> None:
    """Hook ``parent`` so its children ``child_names`` (layers of ``mode`` that its scheme can fuse,
    :meth:`~gridshard.tensor_scheme.TensorScheme.shared_input_fusion`: 1D column layers, 2D and 3D
    linears) are computed together from the parent's first input.

    The parent's input is *replaced* by the prepared one (1D: the full sequence under SP),
    so the parent's own code sees the shapes a single device would (e.g. attention reads
    the sequence length from it)."""
    children = [getattr(parent, n) for n in child_names]
    fused = mode.shared_input_fusion(children)
    if fused is None or len({(c.bias is None) for c in children}) != 1:
        return
    prep, compute, in_dim = fused

    def prepare(module, args, kwargs):
        x = first_input(args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_dim:
            return None                       # let the children compute (and report) on their own
        prepared = prep(children, x)
        if prepared is None:
            return None
        xp = prepared[0] if isinstance(prepared, tuple) else prepared
        for child, y in zip(children, compute(children, prepared)):
            child.precomputed.leave(xp, y)
        return replace_input(args, kwargs, xp)

    parent.register_forward_pre_hook(prepare, with_kwargs=True)
