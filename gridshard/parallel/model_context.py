"""What a parallelised model needs around its forward: token layout, logits, loss, layouts.

:func:`gridshard.parallelize` attaches one :class:`ParallelContext` to the model
(``model.parallel_context``). Per tensor mode:

======  =============================  ==================================  =====================================
mode    tokens / targets per rank      logits per rank                      loss
======  =============================  ==================================  =====================================
none    [b, s]                         [b, s, V]                            ``F.cross_entropy`` (fp32)
1d      [b, s] (also under SP)         [b, s, V_p/T] vocab block t          vocab-parallel CE per token, reduced
2d      [b/q, s] batch block i         [b/q, s, V_p/q] (i, j)               ``cross_entropy_2d`` (global)
2.5d    [b/(dq), s] block k·q + i      [b/(dq), s, V_p/q] (k, i, j)         ``cross_entropy_2d`` on layer k
3d      tokens [b/q², s] block i·q+j,  [b/q², s, V_p/q] batch block i·q+l,  ``cross_entropy_3d`` on the swapped
        targets block i·q + l          vocab block j (swapped orientation)  orientation (``mesh.cube.swapped()``)
======  =============================  ==================================  =====================================

In 3D the embedding reads the residual orientation's batch block (i·q + j) but the head writes its
logits in the swapped one (i·q + l), so tokens and targets are cut differently: :meth:`shard_tokens`
for what the model reads, :meth:`shard_targets` for what the loss compares (the mesh's
``batch_index`` and ``logits_batch_index``; equal in every other mode). The trainer, validation and
the pipeline's last stage cut targets with :meth:`shard_targets` only.

The same for a Hugging Face model (``hf=True``: only the logits call differs). A classifier
(``objective="classify"``, the ViT) takes images [b, C, H, W] (2D: batch block i) and one label per
image, its heads give full logits [b', K] per rank, and its loss is
:func:`gridshard.nn.classification_loss.classification_loss`. Reductions
over the N non-ignored targets of the tensor group's micro-batch, the same scalar on every
tensor rank, with ℓ_i the per-token cross-entropy:

* ``"mean"``: Σ ℓ_i / N, as ``F.cross_entropy(ignore_index=...)``; N = 0 gives NaN with a
  zero gradient (again as ``F.cross_entropy``), on every path;
* ``"sum"``: Σ ℓ_i; 0 with a zero gradient when N = 0. The trainer uses this one and
  divides by the global valid count of the step itself (:mod:`gridshard.engine.trainer`).

Context parallelism (a mesh with C > 1 context ranks): ``shard_tokens`` gives each context rank
its two chunks of every sequence ([b, 2c]), and the loss covers those tokens only: "sum" is the
rank's share of the sequence's sum, "mean" its own tokens' mean (the trainer sums over context
ranks, :mod:`gridshard.engine.step`).

``layouts`` maps every parameter name (tied names included) to its
:class:`gridshard.nn.sharding.ShardSpec`: the one description of where each block sits in
the canonical global tensor, read by gradient clipping, the optimizer, parameter
accounting and :func:`gridshard.parallel.gathered_state_dict`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm.grid_ops import GatheredVectors
from ..context import shard_sequence
from ..errors import LayoutError, ShapeError, check_divisible
from ..job_layout import TensorMode
from ..tensor.tp2d.cross_entropy import REDUCTIONS


@dataclass
class ParallelContext:
    """``mode``: the mesh's :class:`gridshard.job_layout.TensorMode` (a config string is
    parsed); ``sequence_parallel``: whether it is in effect (decided by ``parallelize``)."""

    mesh: object
    mode: TensorMode
    sequence_parallel: bool
    vocab_size: int
    hf: bool = False
    layouts: dict = field(default_factory=dict)
    # 2D biases/norm weights gathered once per optimizer step: ``with ctx.vector_cache.window():``
    vector_cache: GatheredVectors = field(default_factory=GatheredVectors)
    # what the loss compares: "next_token" (a language model, the table above) or "classify" (one
    # label per input, full logits [b', K] per rank: gridshard.nn.classification_loss)
    objective: str = "next_token"

    def __post_init__(self):
        self.mode = TensorMode.parse(self.mode)

    def shard_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Global tokens [b, s] → what this rank feeds the model (a classifier's images and labels too):
        2D, the grid row's block of rows (2.5D: block k·q + i of d·q, depth layer k's slice; 3D: block
        i·q + j of q²); context parallelism (C > 1), the context rank's chunks i and 2C − 1 − i of every
        sequence, [b, 2c] (:func:`gridshard.context.shard_sequence`)."""
        return self._shard(tokens, self.mesh.batch_index)

    def shard_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global targets [b, s] → what this rank's loss compares with its logits: the block of the
        head's logits (``mesh.logits_batch_index``: i·q + l in 3D, module docstring; the tokens'
        block in every other mode; a classifier's labels: the images' block, its head reads the residual
        orientation, :mod:`gridshard.tensor.tp3d.vision`)."""
        return self._shard(targets, self.mesh.batch_index if self.objective == "classify" else
                           self.mesh.logits_batch_index)

    def shard_documents(self, documents: torch.Tensor) -> torch.Tensor:
        """Global document ids [b, S] of packed windows → the rows of this rank's attention, whole
        sequences even under context parallelism (every context rank reads the masks of every
        chunk from them, :mod:`gridshard.nn.documents`). Attention reads q, k, v, projections of
        the residual stream, whose rows are in the orientation the head's logits are in
        (``mesh.logits_batch_index``: the tokens' block but in 3D, i·q + l)."""
        return self._shard(documents, self.mesh.logits_batch_index, whole_sequences=True)

    def _shard(self, tokens: torch.Tensor, index: int, whole_sequences: bool = False) -> torch.Tensor:
        context = self.mesh.context
        if context.size > 1 and not whole_sequences:
            tokens = shard_sequence(tokens, context.size, context.rank, dim=1).contiguous()
        n = self.mesh.batch_blocks                 # 2D: q grid rows; 2.5D: d·q, block k·q + i; 3D: q²
        if n == 1:
            return tokens
        check_divisible(tokens.shape[0], n, "batch", self.mode.batch_blocks_name(self.mesh),
                        f"use a batch that is a multiple of {n}")
        return tokens.chunk(n, 0)[index].contiguous()

    def logits(self, model: torch.nn.Module, tokens: torch.Tensor, documents=None) -> torch.Tensor:
        """This rank's logits for this rank's tokens (a Hugging Face model under context
        parallelism is given their global positions: :func:`gridshard.models.hf.position_ids`);
        ``documents``: this rank's :meth:`shard_documents` of packed windows (gridshard's Llama)."""
        if documents is not None:
            return model(tokens, documents=documents)
        if self.hf:
            context = self.mesh.context
            if context.size == 1:
                return model(input_ids=tokens, use_cache=False).logits
            from ..models.hf import position_ids

            positions = position_ids(tokens.shape[-1], (context.size, context.rank), tokens.device)
            return model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        return model(tokens)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy over all global non-ignored targets of the tensor group's batch, the same
        scalar on every tensor rank: their mean (NaN with zero gradient when every target is
        ignored, as ``F.cross_entropy``) or, with ``reduction="sum"``, their sum (0 then)."""
        if reduction not in REDUCTIONS:
            raise ShapeError(f"ParallelContext.loss: reduction={reduction!r} is not one of {REDUCTIONS}. Fix: use "
                             f"'mean' or 'sum'.")
        if self.objective == "classify":
            return self.mode.classification_loss(logits, targets, self.mesh, ignore_index, reduction)
        return self.mode.lm_loss(logits, targets, self, ignore_index, reduction)

    def model_loss(self, model, tokens, targets, ignore_index: int = -100, reduction: str = "mean",
                   documents=None) -> torch.Tensor:
        return self.loss(self.logits(model, tokens, documents), targets, ignore_index, reduction)


def context_of(model: torch.nn.Module) -> ParallelContext:
    ctx = getattr(model, "parallel_context", None)
    if ctx is None:
        raise LayoutError(f"{type(model).__name__} has not been laid out: call gridshard.parallelize(model, mesh) "
                          f"first.")
    return ctx
