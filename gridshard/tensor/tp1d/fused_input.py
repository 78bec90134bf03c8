"""1D's shared-input product (:mod:`gridshard.parallel.shared_input`): q|k|v or gate|up as one column
product of x on the concatenated local blocks, x prepared once (the sequence all-gather under SP, else
``copy_to_group``; the input gradient's collective overlapped with the weight gradient)."""
from __future__ import annotations

import torch

from ...comm.dual_ops import copy_to_group
from .linear import ColumnParallelLinear, column_product, is_sequence_first
from .input_grad_overlap import column_input


def fusion(children):
    """(prepare, compute, input width) for ColumnParallelLinear children that can share one input, else None."""
    first = children[0]
    if any(type(c) is not ColumnParallelLinear or c.skip_bias_add or c.gather_output
           or c.sequence_parallel != first.sequence_parallel for c in children):
        return None
    return _prepare_1d, _fused_1d, first.in_features


def _prepare_1d(children, x):
    """(full input, handoff): the sequence all-gather under SP, else x itself; the handoff
    carries the input gradient's collective from the product to this entry (overlapped
    with the weight gradient, :mod:`gridshard.tensor.tp1d.input_grad_overlap`) and, under SP, the
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
