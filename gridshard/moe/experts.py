"""The experts of a Mixture-of-Experts layer: n SwiGLU MLPs held as two stacked weights.

    gate_up_proj [n, 2f, h] (gate rows, then up rows),  down_proj [n, h, f]    (expert e: row e, as nn.Linear)
    expert_e(x) = down_e(silu(g) · u),   [g | u] = gate_up_e(x)

silu(g)·u is :func:`gridshard.nn.swiglu.swiglu`, as in the dense Llama's MLP: kept for backward
are g and u (two views of the grouped product's [M, 2f] output) and the product (down's input),
not silu(g), which the backward computes again from g (Megatron's fused ``bias_swiglu``); the
gradients are those of ``F.silu(g) * u`` bit for bit.

The layout and names are Hugging Face's (transformers 5: ``MixtralExperts``, ``Qwen3MoeExperts``),
so its MoE weights import by a rename, as a dense Llama's do.

:meth:`Experts.forward` takes the token rows already sorted by expert, with the number of rows
of each expert, and runs all experts as one *grouped* product per weight: row block e times
weight e. Where PyTorch's grouped GEMM applies (``torch.nn.functional.grouped_mm``: CUDA, bf16)
it is one kernel; elsewhere each expert's block is one ``F.linear`` (:func:`grouped_linear`).
The loop is written here because PyTorch's grouped product runs its backward only on CUDA
(torch 2.13 on CPU: the forward works for fp32 with 16-byte-aligned rows, the backward fails with
"Invalid strides/sizes"), and the whole training path must run on gloo/CPU too.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.swiglu import swiglu


def _grouped_kernel_applies(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Rows of ``x`` [M, in] in expert blocks of ``counts`` (Σ counts = M) times ``weight``
    [n, out, in]: block e → block e · weight[e]ᵀ; [M, out]. Empty blocks are allowed."""
    if _grouped_kernel_applies(x):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight.to(x.dtype).transpose(1, 2), offs=offsets)
    # an empty block still joins the graph: every expert's weight gets a gradient (zeros if unused);
    # unbind, not weight[e]: its backward stacks the n gradients once instead of adding n full-size ones
    return torch.cat([F.linear(block, w) for block, w in zip(x.split(list(counts)), weight.unbind(0))])


class Experts(nn.Module):
    """n SwiGLU experts (module docstring)."""

    def __init__(self, n_experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, ffn_hidden))

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x [M, h] sorted by expert, ``counts`` [n] rows per expert → [M, h] in the same order."""
        gate, up = grouped_linear(x, self.gate_up_proj, counts).chunk(2, dim=-1)
        return grouped_linear(swiglu(gate, up), self.down_proj, counts)
