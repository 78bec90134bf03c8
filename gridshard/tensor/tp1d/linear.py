"""Megatron 1D tensor-parallel linear layers: column-parallel and row-parallel.

Notation: T ranks in the tensor group, rank t; a linear layer y = x Wᵀ + b with a
global weight W [out, in] (PyTorch layout, drawn ``normal_(0, init_std)``).

Column-parallel (W split along ``out``)
---------------------------------------
Rank t holds W_t = rows t·out/T … (t+1)·out/T of W, [out/T, in], and b_t [out/T].
Given the full input x [b, s, in] it computes its block of output columns

    y_t = x W_tᵀ + b_t                                   [b, s, out/T]

with no communication. The input is used by all T ranks, so its gradient is the
sum of T partials: ``copy_to_group`` (forward identity, backward all-reduce of
b·s·in).

Under sequence parallelism the input arrives as the sequence block x_t
[b, s/T, in]; the entry (:func:`gridshard.tensor.tp1d.input_grad_overlap.column_input`) all-gathers
the full x along dim 1 (forward, b·s·in) and reduce-scatters its gradient (backward, b·s·in)
instead of the copy. The product keeps only x_t for backward (b·s/T·in, not the gathered
b·s·in) and all-gathers it once more in backward for the weight gradient (b·s·in: the
price of the smaller activation, Megatron's choice; :class:`_ColumnProduct`).
The block is stored sequence-first and so is the gathered x; the product is taken on
its [s, b, in] view, so neither the collectives nor the GEMM
reorder it, and y comes out sequence-first too.

``gather_output=True`` all-gathers y along the last dim so every rank gets the full
[b, s, out].

Row-parallel (W split along ``in``)
-----------------------------------
Rank t holds W_t = columns t·in/T … of W, [out, in/T], and the *full* bias b [out].
Its input is x_t [b, s, in/T] (the output of a column layer: ``input_is_parallel``)
and it computes the partial product p_t = x_t W_tᵀ [b, s, out]. The output is

    y = Σ_t p_t + b      (all-reduce of b·s·out; backward identity)

or, under sequence parallelism, the sequence block t of that sum
(``reduce_scatter_sequence``: forward reduce-scatter of b·s·out, backward
all-gather of b·s·out; the partial product is computed sequence-first, so the
reduce-scatter needs no reorder copy: :mod:`gridshard.comm.dual_ops`). The bias is
added exactly once, after the reduction. Under SP the bias meets only the sequence
block t; its gradient Σ_tokens ∂L/∂y is taken from the all-gathered output gradient
that the backward of the reduce-scatter computes anyway
(``reduce_scatter_sequence_bias``), so it is complete on every rank with no
collective of its own. With ``skip_bias_add`` the caller adds the bias to the block,
so it is handed out through ``copy_to_group`` (backward all-reduce of out·bytes).
Either way the spec is marked ``partial_grad_axes=("tensor",)``: the
block's share is partial, and it is made whole inside the layer (do not reduce again).

Column → row needs no communication between them (the column output block t is
exactly the row input block t), hence one all-reduce forward and one backward per
pair (or one all-gather + one reduce-scatter each way under SP).

What a layer is told, not what it decides: the layers of :mod:`gridshard.nn` take the layout
facts they need as constructor arguments (the mesh's tensor axis, ``sequence_parallel``,
``replicate`` for shared kv heads) and never see the job's config or world. ``parallelize``
passes ``sequence_parallel`` already *in effect* (:class:`gridshard.job_layout.JobLayout`); a
layer built directly reads the request through the same rule
(:meth:`gridshard.job_layout.TensorMode.sequence_parallel_in_effect`: off at T = 1).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.dual_ops import (copy_to_group, gather_from_group, reduce_from_group, reduce_scatter_sequence,
                              reduce_scatter_sequence_bias, scatter_to_group, sum_over_replicas)
from .input_grad_overlap import column_input
from ...errors import LayoutError, ShapeError, check_divisible
from ...nn.precomputed import PrecomputedOutput
from ...nn.sharding import ShardSpec, sharded_parameter, sequence_parallel_on
from ...torch_private import will_execute

T_NAME = "tensor-parallel size T"


def _normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda full: full.normal_(0.0, std)


def _zeros(full: torch.Tensor) -> None:
    full.zero_()


def check_last_dim(x: torch.Tensor, expected: int, layer: str, fix: str) -> None:
    """ShapeError unless ``x.shape[-1] == expected`` (checked before any collective)."""
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ShapeError(f"{layer}: input of shape {tuple(x.shape)} has last dim "
                         f"{x.shape[-1] if x.dim() else None}, expected {expected}. Fix: {fix}.")


def check_sequence_input(x: torch.Tensor, layer: str) -> None:
    """Sequence-parallel activations are [b, s, h] with the sequence on dim 1."""
    if x.dim() != 3:
        raise ShapeError(f"{layer}: sequence parallelism needs a 3-D activation [batch, seq, hidden] with the "
                         f"sequence on dim 1, got shape {tuple(x.shape)}. Fix: reshape the input to [b, s, h].")


def check_sequence_divisible(x: torch.Tensor, T: int, layer: str) -> None:
    """The full sequence must split evenly into T blocks before a reduce-scatter along it."""
    check_sequence_input(x, layer)
    check_divisible(x.shape[1], T, f"{layer}: sequence length s", T_NAME,
                    f"use a sequence length that is a multiple of {T}, or turn sequence_parallel off")


def is_sequence_first(x: torch.Tensor) -> bool:
    """A [b, s, ..] tensor stored as a contiguous [s, b, ..] (the layout of sequence-parallel
    activations, :mod:`gridshard.comm.dual_ops`), and not also plainly contiguous (b = 1)."""
    return x.dim() >= 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous()


def linear_in_layout(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` that keeps a sequence-first input's layout: computed on the contiguous
    [s, b, in] view (a plain GEMM of b·s rows; ``F.linear`` on the [b, s, in] view would first
    copy it batch-first) and returned as the [b, s, out] view of the [s, b, out] result."""
    if is_sequence_first(x):
        return F.linear(x.transpose(0, 1), weight, bias).transpose(0, 1)
    return F.linear(x, weight, bias)


def linear_sequence_first(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·Wᵀ for x [b, s, in] with the result stored sequence-first ([b, s, out] view of a
    contiguous [s, b, out]), ready for the sequence reduce-scatter without a reorder copy. A
    batch-first x is read through its [s, b, in] view (the GEMM copies x, in elements per
    token, instead of the reduce-scatter copying the result, out per token)."""
    return F.linear(x.transpose(0, 1), weight).transpose(0, 1)


class _ColumnProduct(torch.autograd.Function):
    """y = x·[W₀; W₁; …]ᵀ for a column layer (or several sharing one input), saving x and the
    parts (parameters: no copy), not the joined weight, which is rebuilt in backward. A
    sequence-first x is multiplied as its contiguous [s, b, in] view and y comes back
    sequence-first. Backward: dx = dy·W first; with a ``handoff``
    (:mod:`gridshard.tensor.tp1d.input_grad_overlap`) its collective starts now and runs while
    dW = dyᵀ·x is computed — only if this backward will reach the entry node that waits for
    it (:func:`gridshard.torch_private.will_execute`, as ``torch.autograd.graph.register_multi_grad_hook``
    uses it): a pass that wants only weight gradients (zero bubble's deferred weight pass,
    ``autograd.grad`` w.r.t. parameters) launches nothing. Under sequence parallelism x is the
    all-gather of the rank's sequence block x_t: only x_t is saved (s/T·b·in elements instead
    of s·b·in), and backward all-gathers it again — started before dx is computed, waited for
    before dW (Megatron's choice; :mod:`gridshard.tensor.tp1d.input_grad_overlap`). Under autocast
    both operands are cast to the autocast dtype, as ``F.linear`` would (the saved x or x_t in
    that dtype)."""

    @staticmethod
    def forward(ctx, x, handoff, *parts):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        seq_first = is_sequence_first(x)
        xs = (x.transpose(0, 1) if seq_first else x).to(dtype)
        block = _saved_block(x, handoff)
        ctx.save_for_backward(xs if block is None else block.detach().to(dtype), *parts)
        ctx.in_dtype, ctx.dtype, ctx.seq_first, ctx.handoff = x.dtype, dtype, seq_first, handoff
        ctx.regather = block is not None
        # the entry node that will wait for the early collective (this node's input edge: no cycle)
        ctx.entry = x.grad_fn if handoff is not None and handoff.overlap else None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(xs, parts[0].to(dtype) if len(parts) == 1 else torch.cat(parts, 0).to(dtype))
        return y.transpose(0, 1) if seq_first else y

    @staticmethod
    def backward(ctx, g):
        saved, *parts = ctx.saved_tensors
        wants_dw = any(ctx.needs_input_grad[2:])
        gathering = ctx.handoff.regather(saved) if ctx.regather and wants_dw else None
        gs = (g.transpose(0, 1) if ctx.seq_first else g).to(ctx.dtype)
        w = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (gs @ w.to(ctx.dtype)).to(ctx.in_dtype)
            if ctx.seq_first:
                dx = dx.transpose(0, 1)
            if ctx.entry is not None and will_execute(ctx.entry):
                ctx.handoff.launch(dx)          # the input-gradient collective runs during dW
        if not wants_dw:
            return (dx, None, *(None for _ in parts))
        xs = saved if gathering is None else gathering.wait()
        if gathering is not None and ctx.seq_first:
            xs = xs.transpose(0, 1)
        dw = (gs.reshape(-1, gs.shape[-1]).t() @ xs.reshape(-1, xs.shape[-1]))
        dws = dw.split([p.shape[0] for p in parts], 0) if len(parts) > 1 else (dw,)
        return (dx, None, *(d.to(p.dtype) for d, p in zip(dws, parts)))


def _saved_block(x: torch.Tensor, handoff) -> Optional[torch.Tensor]:
    """Under SP, the sequence block the entry gathered ``x`` from (saved instead of ``x``), or
    None: no SP, no handoff, or a block that is not 1/T of ``x`` along the gathered dim."""
    if handoff is None or not handoff.sequence_parallel:
        return None
    block = handoff.take_block()
    if block is None or block.dim() != x.dim():
        return None
    d = handoff.dim % x.dim()
    return block if block.shape[d] * handoff.axis.size == x.shape[d] else None


def column_product(x: torch.Tensor, parts, handoff=None) -> torch.Tensor:
    """x·[W₀; W₁; …]ᵀ in x's layout (:class:`_ColumnProduct`); ``handoff`` from
    :func:`gridshard.tensor.tp1d.input_grad_overlap.column_input` overlaps the input-gradient
    collective with the weight-gradient GEMM."""
    return _ColumnProduct.apply(x, handoff, *parts)


class ColumnParallelLinear(nn.Module):
    """y_t = x W_tᵀ + b_t with W [out, in] split along ``out`` over ``mesh.tensor``.

    Input: [.., in] replicated (or [b, s/T, in] sequence block with ``sequence_parallel``).
    Output: [.., out/T] this rank's column block ([.., out] with ``gather_output``).
    With ``skip_bias_add`` returns ``(output, bias)`` (bias shard, or the full bias when
    gathering; ``None`` without bias) and leaves the addition to the caller.
    ``weight_init`` (global [out, in] tensor → None, in place) overrides the default
    ``normal_(0, init_std)``; ``shared_weight`` reuses an existing parameter of the same
    spec (e.g. a tied embedding) and draws nothing. ``overlap_input_grad``: in backward the
    input gradient's collective runs during the weight-gradient GEMM
    (:mod:`gridshard.tensor.tp1d.input_grad_overlap`), or after it when False (exact either way).
    ``canonical_out``: the real row count of a weight whose ``out_features`` is padded (a
    vocabulary head padded so that T divides it): the spec's canonical shape is then
    [canonical_out, in] and the rows from it on are padding.
    """

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None,
                 weight_init: Optional[Callable[[torch.Tensor], None]] = None,
                 shared_weight: Optional[nn.Parameter] = None, replicate: int = 1, overlap_input_grad: bool = True,
                 canonical_out: Optional[int] = None):
        super().__init__()
        self.axis = mesh.tensor
        T = self.axis.size
        if replicate < 1 or T % replicate or (replicate > 1 and gather_output):
            raise LayoutError(f"ColumnParallelLinear(replicate={replicate}) on T={T}: groups of `replicate` ranks "
                              f"share one block, so replicate must divide T (and gather_output must be off). "
                              f"Fix: use a divisor of {T}.")
        self.replicate = replicate
        blocks = T // replicate
        check_divisible(out_features, blocks, "ColumnParallelLinear out_features", T_NAME,
                        f"use out_features that is a multiple of {blocks}, or a tensor size that divides "
                        f"out_features = {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.out_local = out_features // blocks
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        self.overlap_input_grad = overlap_input_grad
        self.precomputed = PrecomputedOutput()    # shared-input parents leave outputs here
        w_spec = ShardSpec((out_features, in_features), ((0, "tensor"),), replicate=replicate,
                           canonical_shape=None if canonical_out is None else (canonical_out, in_features))
        if shared_weight is not None:
            shared_spec = getattr(shared_weight, "shard_spec", None)
            uncut = lambda spec: replace(spec, canonical_shape=None)  # noqa: E731 (padding cut aside)
            if shared_spec is None or uncut(shared_spec) != uncut(w_spec):
                raise LayoutError(f"ColumnParallelLinear: shared_weight has spec "
                                  f"{getattr(shared_weight, 'shard_spec', None)}, expected {w_spec}. Fix: share a "
                                  f"weight split the same way (global [{out_features}, {in_features}], rows over T).")
            self.weight = shared_weight
        else:
            self.weight = sharded_parameter(w_spec, mesh, weight_init or _normal(init_std), dtype, device)
        if bias:
            b_spec = ShardSpec((out_features,), ((0, "tensor"),), replicate=replicate)
            self.bias = sharded_parameter(b_spec, mesh, _zeros, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        name = "ColumnParallelLinear"
        left = self.precomputed.take(x)
        if left is not None:
            return left
        check_last_dim(x, self.in_features, name, f"feed [.., {self.in_features}] (the layer's in_features)")
        if self.sequence_parallel:
            check_sequence_input(x, name)
        weight, bias = self.local_weight_and_bias()
        if self.overlap_input_grad or self.sequence_parallel:     # SP: saves its block, re-gathers in backward
            x, handoff = column_input(x, self.axis, self.sequence_parallel, overlap=self.overlap_input_grad)
            y = column_product(x, (weight,), handoff)
            if bias is not None and not self.skip_bias_add:
                y = y + bias.to(y.dtype)                  # as F.linear under autocast
        else:
            y = linear_in_layout(copy_to_group(x, self.axis), weight, None if self.skip_bias_add else bias)
        if self.gather_output:
            y = gather_from_group(y, self.axis, -1)
            if self.skip_bias_add and bias is not None:
                bias = gather_from_group(bias, self.axis, -1)
        return (y, bias) if self.skip_bias_add else y

    def local_weight_and_bias(self):
        """The blocks to compute with: as stored, or (``replicate`` > 1) through
        :func:`sum_over_replicas` so ranks sharing a block sum their gradients."""
        if self.replicate == 1:
            return self.weight, self.bias
        b = None if self.bias is None else sum_over_replicas(self.bias, self.axis, self.replicate)
        return sum_over_replicas(self.weight, self.axis, self.replicate), b

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_local}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = Σ_t x_t W_tᵀ + b with W [out, in] split along ``in`` over ``mesh.tensor``.

    Input: [.., in/T] this rank's block (``input_is_parallel``) or [.., in] replicated
    (then split here). Output: [.., out] replicated, or the sequence block [b, s/T, out]
    with ``sequence_parallel``. The full bias is added once, after the reduction;
    ``skip_bias_add`` returns ``(output, bias)`` instead.
    """

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.axis = mesh.tensor
        T = self.axis.size
        check_divisible(in_features, T, "RowParallelLinear in_features", T_NAME)
        self.sequence_parallel = sequence_parallel_on(mesh, sequence_parallel)
        if self.sequence_parallel and not input_is_parallel:
            raise LayoutError("RowParallelLinear(sequence_parallel=True, input_is_parallel=False): under sequence "
                              "parallelism the row layer's input must be the column-split activation. "
                              "Fix: set input_is_parallel=True (feed it the output of a ColumnParallelLinear).")
        self.in_features, self.out_features = in_features, out_features
        self.in_local = in_features // T
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        w_spec = ShardSpec((out_features, in_features), ((1, "tensor"),))
        self.weight = sharded_parameter(w_spec, mesh, _normal(init_std), dtype, device)
        if bias:
            b_spec = ShardSpec((out_features,), (), partial_grad_axes=("tensor",) if self.sequence_parallel else ())
            self.bias = sharded_parameter(b_spec, mesh, _zeros, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        name = "RowParallelLinear"
        T = self.axis.size
        if self.input_is_parallel:
            if T > 1 and x.dim() and x.shape[-1] == self.in_features:
                raise ShapeError(
                    f"{name}(input_is_parallel=True): input last dim is {x.shape[-1]} = the FULL in_features, but "
                    f"this rank expects its block of in_features/T = {self.in_local}. The input was probably "
                    f"gathered (a preceding ColumnParallelLinear with gather_output=True). Fix: use "
                    f"gather_output=False before a row layer, or input_is_parallel=False.")
            check_last_dim(x, self.in_local, name, f"feed this rank's block [.., in_features/T = {self.in_local}]")
        else:
            check_last_dim(x, self.in_features, name, f"feed the full input [.., {self.in_features}]")
        if self.sequence_parallel:
            check_sequence_divisible(x, T, name)
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.axis, -1)
        if self.sequence_parallel:
            partial = linear_sequence_first(x, self.weight)
            if self.bias is not None and not self.skip_bias_add:
                return reduce_scatter_sequence_bias(partial, self.bias, self.axis, 1)
            y = reduce_scatter_sequence(partial, self.axis, 1)
        else:
            y = reduce_from_group(F.linear(x, self.weight), self.axis)
        bias = self.bias
        if bias is not None and self.sequence_parallel:      # skip_bias_add: the caller adds it to a block
            bias = copy_to_group(bias, self.axis)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias.to(y.dtype)    # autocast: y in the compute dtype, as F.linear's

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_local}), out={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
