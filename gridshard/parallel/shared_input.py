"""One input, several column projections: one collective and one matmul.

Attention reads its input x through q, k and v; the MLP through gate and up. Laid out as
separate column layers, each would prepare x on its own — 1D: three ``copy_to_group``
(three all-reduces of ∂L/∂x in backward) or three sequence all-gathers; 2D: three SUMMA
products, each broadcasting x's panels along the grid rows. A fused weight avoids that
but breaks the canonical layout (its rank blocks interleave the parts).

So the projections keep separate parameters and the parent module gets a forward
pre-hook that, for its input x,

* 1D: prepares x once (the sequence all-gather under sequence parallelism, else
  ``copy_to_group``) and computes ``x · [W_q; W_k; W_v]_tᵀ`` on the concatenated local
  blocks (+ the concatenated biases); under SP that one product keeps only the rank's
  sequence block for backward and re-gathers it there (:mod:`gridshard.comm.input_grad_overlap`),
  so the gathered x replacing the parent's input lives only through the parent's forward;
* 2D: computes one SUMMA A·B with B = [W_q | W_k | W_v] (the local [in/q, n/q] blocks
  side by side: column j of the grid holds block j of every part, so the product's
  block j is [q block j | k block j | v block j]) and adds each part's gathered bias;

then splits the result into the children's output blocks (made contiguous: models
``view`` them into heads; under SP contiguous in the sequence-first order of the gathered x)
and leaves each child its slice in the child's ``precomputed`` slot
(:mod:`gridshard.nn.precomputed`). Communication per forward+backward is therefore
that of one layer of width Σ out: the old fused-weight figures of
:mod:`gridshard.theory.tp1d` / :mod:`gridshard.theory.tp2d`. If the parent calls a child
with another tensor than its own input, the child just computes on its own (correct,
only without the saving).
"""
from __future__ import annotations

import torch

from ..comm.dual_ops import copy_to_group
from ..comm.input_grad_overlap import column_input
from ..comm.summa import summa_ab_parts
from ..nn.linear_1d import ColumnParallelLinear, column_product, is_sequence_first
from ..nn.linear_2d import Linear2D, gather_vector_2d

_INPUT_NAMES = ("hidden_states", "x", "input")


def _replace_input(args, kwargs, new):
    if args:
        return (new, *args[1:]), kwargs
    for key in _INPUT_NAMES:
        if key in kwargs:
            return args, {**kwargs, key: new}
    return args, kwargs


def _first_input(args, kwargs):
    if args:
        return args[0]
    for key in _INPUT_NAMES:
        if key in kwargs:
            return kwargs[key]
    return None


def _prepare_1d(children, x):
    """(full input, handoff): the sequence all-gather under SP, else x itself; the handoff
    carries the input gradient's collective from the product to this entry (overlapped
    with the weight gradient, :mod:`gridshard.comm.input_grad_overlap`) and, under SP, the
    sequence block the product saves (re-gathered in backward) instead of the full input; or
    None for the two-node order without SP (``copy_to_group``)."""
    first = children[0]
    if first.sequence_parallel and x.dim() != 3:
        return None
    overlap = all(c.overlap_input_grad for c in children)
    if overlap or first.sequence_parallel:
        return column_input(x, first.axis, first.sequence_parallel, overlap=overlap)
    return copy_to_group(x, first.axis), None


def _fused_1d(children, prepared):
    """A sequence-first xp (the SP gather's output) is multiplied as its [s, b, in] view and the
    outputs are made contiguous in that order, returned as [b, s, n] views: every output is
    then stored sequence-first like the rest of the SP region, and no step reorders it."""
    xp, handoff = prepared
    blocks = [c.local_weight_and_bias() for c in children]
    seq_first = is_sequence_first(xp)
    y = column_product(xp, [w for w, _ in blocks], handoff)
    if blocks[0][1] is not None:
        y = y + torch.cat([b for _, b in blocks], 0).to(y.dtype)     # as F.linear under autocast
    if seq_first:
        y = y.transpose(0, 1)
    outs = [o.contiguous() for o in y.split([c.out_local for c in children], -1)]
    return [o.transpose(0, 1) for o in outs] if seq_first else outs


def _fused_2d(children, x):
    first = children[0]
    y = summa_ab_parts(x.reshape(-1, first.in_local), [c.weight for c in children], first.mesh, first.overlap)
    y = y.view(*x.shape[:-1], y.shape[-1])
    outs = y.split([c.out_local for c in children], -1)
    return [o.contiguous() if c.bias is None else o + gather_vector_2d(c.bias, c.mesh, cache=c.vector_cache)
            for o, c in zip(outs, children)]


def install_shared_input(parent: torch.nn.Module, child_names) -> None:
    """Hook ``parent`` so its children ``child_names`` (all ColumnParallelLinear, or all
    Linear2D, same input width) are computed together from the parent's first input.

    The parent's input is *replaced* by the prepared one (1D: the full sequence under SP),
    so the parent's own code sees the shapes a single device would (e.g. attention reads
    the sequence length from it)."""
    children = [getattr(parent, n) for n in child_names]
    kinds = {type(c) for c in children}
    if kinds <= {ColumnParallelLinear}:
        prep, compute, in_dim = _prepare_1d, _fused_1d, children[0].in_features
        if any(c.skip_bias_add or c.gather_output or c.sequence_parallel != children[0].sequence_parallel
               for c in children):
            return
    elif kinds <= {Linear2D}:
        prep, compute, in_dim = (lambda _, x: x), _fused_2d, children[0].in_local
    else:
        return
    if len({(c.bias is None) for c in children}) != 1:
        return

    def prepare(module, args, kwargs):
        x = _first_input(args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_dim:
            return None                       # let the children compute (and report) on their own
        prepared = prep(children, x)
        if prepared is None:
            return None
        xp = prepared[0] if isinstance(prepared, tuple) else prepared
        for child, y in zip(children, compute(children, prepared)):
            child.precomputed.leave(xp, y)
        return _replace_input(args, kwargs, xp)

    parent.register_forward_pre_hook(prepare, with_kwargs=True)
