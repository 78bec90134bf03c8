"""``1d``: Megatron's column/row split on T ranks (docs/tp1d.md).

Each rank holds whole heads (H/T) and MLP neurons (f/T), a vocabulary block of the embedding
and head; kv heads are split when T divides K and shared by T/K ranks when K divides T.
Sequence parallelism (requested, T > 1) splits the residual stream along the sequence.
"""
from __future__ import annotations

from ...errors import LayoutError
from .build import build_1d
from ...nn.classification_loss import masked_mean
from .cross_entropy import vocab_parallel_cross_entropy
from ...tensor_scheme import DivisibilityRule
from ..base import Scheme
from ...theory.memory import RankShape
from ...theory.vocab import padded_vocab_size
from .cost import tensor_comm_1d
from .fused_input import fusion


class OneDScheme(Scheme):
    """Megatron column/row: whole heads and neurons per rank, vocabulary-parallel loss."""

    key, constant, summary = "1d", "ONE_D", "Megatron column/row"

    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        self.check_no_depth(depth)

    def sequence_parallel_in_effect(self, requested: bool, T: int) -> bool:
        """On only when asked for, with T > 1 (at T = 1 there is nothing to split)."""
        return bool(requested) and T > 1

    def head_split(self, T: int) -> int:
        return T

    def kv_replication(self, kv_heads: int, T: int) -> int:
        """T/K ranks share one kv head when K < T (K divides T), else 1."""
        return T // kv_heads if T > kv_heads else 1

    def boundary_block(self, T: int, sequence_parallel: bool, micro: int, seq: int, hidden: int,
                       depth: int = 1) -> tuple:
        """[m, s/T, h] under sequence parallelism (in effect), else the whole [m, s, h]."""
        if self.sequence_parallel_in_effect(sequence_parallel, T):
            return micro, seq // T, hidden
        return micro, seq, hidden

    def layout_rules(self, T: int, hidden: int, heads: int, ffn: int, kv_heads: int) -> list:
        fix = "use a tensor size that divides {}"
        rules = [DivisibilityRule("heads", heads, T, "tensor", "1D gives every rank whole attention heads",
                                  fix=fix.format(heads)),
                 DivisibilityRule("ffn_hidden", ffn, T, "tensor", "1D gives every rank whole MLP neurons",
                                  fix=fix.format(ffn)),
                 DivisibilityRule("hidden", hidden, T, "tensor", "1D splits the hidden size into T blocks",
                                  fix=fix.format(hidden))]
        if kv_heads % T and T % kv_heads:
            rules.append(DivisibilityRule("kv_heads", kv_heads, T, "tensor",
                                          "kv heads are split over T when T divides them, or replicated in groups "
                                          "of T/kv_heads when kv_heads divides T",
                                          fix=f"use a tensor size that divides or is a multiple of {kv_heads}"))
        return rules

    def batch_rules(self, T: int, sequence_parallel: bool, batch: int, seq: int) -> list:
        if not sequence_parallel:
            return []
        return [DivisibilityRule("seq_len", seq, T, "tensor",
                                 "sequence parallelism splits the residual stream along the sequence")]

    def build_layer(self, name, module, kind: str, build, tied=None):
        """The 1D layer of ``kind`` (:func:`gridshard.tensor.tp1d.build.build_1d`)."""
        return build_1d(name, module, kind, build.mesh, build.sequence_parallel, build.sp_in_embedding,
                        build.kv_replication, overlap_input_grad=build.overlap_input_grad, tied_embedding=tied)

    def token_gathers(self, mesh, sequence_parallel: bool) -> tuple:
        """Under sequence parallelism the sequence blocks of ``tensor``; otherwise nothing."""
        return ((mesh.tensor, 1),) if self.sequence_parallel_in_effect(sequence_parallel, mesh.tensor.size) else ()

    def check_replicated(self, name: str, module, sequence_parallel: bool) -> None:
        """A replicated module sees the whole activation, except under sequence parallelism."""
        if sequence_parallel:
            raise LayoutError(f"parallelize: module {name!r} is planned as 'replicate', but under sequence "
                              f"parallelism its input is a sequence block, not the whole activation. Fix: map "
                              f"it to column/row/norm, or turn sequence_parallel off.")

    def lm_loss(self, logits, targets, ctx, ignore_index: int, reduction: str):
        """Vocabulary-parallel cross-entropy per token (logits [b, s, V_p/T], vocab block t), reduced."""
        per_token = vocab_parallel_cross_entropy(logits, targets, ctx.mesh.tensor, ignore_index,
                                                 vocab_size=ctx.vocab_size)
        total = per_token.sum()
        if reduction == "sum":
            return total
        return masked_mean(total, (targets != ignore_index).sum())

    def rank_shape(self, cfg, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
        """All rows; the residual split over T under sequence parallelism; H/T heads, f/T neurons,
        V_p/T vocabulary columns."""
        h = cfg.hidden
        R = tokens * h // T if self.sequence_parallel_in_effect(sequence_parallel, T) else tokens * h
        return RankShape(tokens, R, cfg.heads // T, self.local_kv_heads(cfg.kv_heads, T), cfg.ffn_hidden // T,
                         padded_vocab_size(cfg.vocab_size, T) // T)

    def autocast_weight_elements(self, cfg, T: int) -> tuple:
        """The row layers o_proj and down_proj only (the column layers' copies are not kept)."""
        r = self.rank_shape(cfg, T, False, 0)
        return cfg.hidden * (r.heads * cfg.head_dim + r.ffn), 0

    def head_and_loss_saved_bytes(self, cfg, T: int, r: RankShape, e: int) -> int:
        return self.masked_loss_bytes(r)

    def class_head_saved_bytes(self, cfg, T: int, r: RankShape, batch: int, e: int, pb: int,
                               sequence_parallel: bool = False) -> int:
        """The replicated classifier's (:class:`gridshard.tensor.tp1d.classifier.Classifier1D`); under
        sequence parallelism (``sequence_parallel``: in effect) it keeps the gathered first rows of the T
        blocks (b·T·h·e), not the norm's output."""
        if not sequence_parallel:
            return super().class_head_saved_bytes(cfg, T, r, batch, e, pb)
        copy = cfg.hidden * cfg.num_classes * e if e < pb else 0
        return batch * T * cfg.hidden * e + copy + self.class_loss_bytes(cfg, r, batch)

    def tensor_comm(self, cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> dict:
        """:func:`gridshard.tensor.tp1d.cost.tensor_comm_1d` on the tensor group's one link."""
        return {"tensor": tensor_comm_1d(cfg, layout, seq, layers, first, last, e)} if layout.tensor > 1 else {}

    def tensor_ring_members_per_node(self, T: int, per_node: int) -> int:
        """The tensor group is T consecutive ranks, one ring: min(T, per_node) of them in each node."""
        return min(T, per_node)

    def shared_input_fusion(self, children):
        """q|k|v (gate|up) as one column product of x prepared once (:mod:`gridshard.tensor.tp1d.fused_input`)."""
        return fusion(children)
