"""Which model and batch sizes each tensor mode can lay out: pure functions, no process groups.

The config validator checks these before any worker starts, so a bad layout fails before
any process group exists; :func:`gridshard.parallel.check_layout` applies the same layout
rules (:func:`layout_rules`: the ones that do not depend on batch or sequence) when
:func:`gridshard.parallelize` lays a model out. Rules (T tensor ranks, q = √T; K kv heads):

======== ==========================================================================
mode     rule
======== ==========================================================================
all      hidden % heads == 0 (whole heads) and head_dim even (rotate-half RoPE);
         heads % K == 0 (layout rule: each kv head serves a whole group of heads)
1d       heads % T == 0, ffn % T == 0 (each rank holds whole heads / neurons), hidden % T == 0,
         K % T == 0 or T % K == 0 (kv heads split, or shared by T/K ranks) — layout rules
1d + SP  additionally seq % T == 0 (residual stream split along the sequence)
2d       heads % q, ffn % q, K % q == 0 (split dims in q blocks), hidden % q² == 0 (the
         norm weights are stored in q² blocks) — layout rules; micro-batch % q == 0 (grid
         row i holds batch block i)
3d       heads % q, K % q == 0 (each rank attends with H/q heads and K/q kv heads), ffn % q²
         == 0 (the down projection's input is cut into q² blocks), hidden % q³ == 0 (the
         norm weights are stored in q³ blocks; implies the q² input blocks of q|k|v, gate|up
         and the head) — layout rules; micro-batch % q² == 0 (rank (i, j, l) holds batch
         block i·q + j of q²); q = ∛T
======== ==========================================================================

The vocabulary needs no rule: the vocab-parallel layers pad it to a multiple of the
split (padding rows are zero and never targeted).
"""
from __future__ import annotations

from dataclasses import replace

from ..tensor_scheme import DivisibilityRule, TensorMode


# the size each rule is about -> the keyword of model_shape_rules that sets it
_FIELD_ARGS = {"hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "ffn_hidden": "ffn",
               "seq_len": "seq", "micro_batch": "batch"}


def layout_rules(mode, tensor: int, hidden: int, heads: int, ffn: int, kv_heads=None) -> list:
    """The rules a model's dimensions must meet to be laid out in ``mode`` on ``tensor`` ranks,
    whatever its batch and sequence: grouped-query attention, then the mode's splits (module
    docstring). The one list of them: the config validator reads it through
    :func:`model_shape_rules`, ``parallelize`` through :func:`gridshard.parallel.check_layout`."""
    kv_heads = kv_heads or heads
    rules = [DivisibilityRule("heads", heads, kv_heads, "kv_heads", "each kv head serves a whole group of heads")]
    return rules + TensorMode.parse(mode).layout_rules(tensor, hidden, heads, ffn, kv_heads)


def _rules(mode: str, tensor: int, sequence_parallel: bool, batch: int, seq: int, hidden: int, heads: int,
           ffn: int, kv_heads=None) -> list:
    mode = TensorMode.parse(mode)
    gqa, *splits = layout_rules(mode, tensor, hidden, heads, ffn, kv_heads)
    rules = [DivisibilityRule("hidden", hidden, heads, "heads", "every head needs hidden/heads channels"), gqa]
    if heads > 0 and hidden % heads == 0:
        rules.append(DivisibilityRule("head_dim", hidden // heads, 2, "2",
                                      "rotary embeddings rotate channel pairs (head_dim = hidden/heads)"))
    return rules + splits + mode.batch_rules(tensor, sequence_parallel, batch, seq)


def _mentions(rule: DivisibilityRule, field: str) -> bool:
    """Whether changing size ``field`` can change ``rule``'s verdict."""
    names = {rule.what, rule.by} | ({"hidden", "heads"} if rule.what == "head_dim" else set())
    return field in names


def _broken(sizes: dict) -> set:
    return {(r.what, r.by) for r in _rules(**sizes) if not r.holds}


def _valid_values(field: str, value: int, step: int, sizes: dict, limit: int = 48) -> tuple:
    """The nearest multiples of ``step`` below and above ``value`` (at most one each, searched
    up to ``limit`` steps away) that fix every rule about size ``field`` and break no rule that
    held: changing ``field`` to one of them (the other sizes unchanged) leaves broken only
    rules about other sizes that were broken already."""
    arg = _FIELD_ARGS[field]
    others = {(r.what, r.by) for r in _rules(**sizes) if not r.holds and not _mentions(r, field)}

    def ok(v):
        return _broken({**sizes, arg: v}) <= others

    below = next((v for v in range((value - 1) // step * step, 0, -step)[:limit] if ok(v)), None)
    above = next((v for v in range((value // step + 1) * step, (value // step + 1 + limit) * step, step)
                  if ok(v)), None)
    return tuple(v for v in (below, above) if v is not None)


def model_shape_rules(mode: str, tensor: int, sequence_parallel: bool, batch: int, seq: int,
                      hidden: int, heads: int, ffn: int, kv_heads=None, hints: bool = True) -> list:
    """All divisibility rules for one layout; ``batch`` is the micro-batch of one tensor group.
    ``kv_heads`` (grouped-query attention, default = heads): 1D splits them when T divides
    them and replicates them in groups of T/kv_heads when they divide T; 2D needs kv_heads % q.
    A broken rule carries nearby values of its size that fix it without breaking another
    (``hints=False``: the verdicts only, without that search)."""
    sizes = dict(mode=mode, tensor=tensor, sequence_parallel=sequence_parallel, batch=batch, seq=seq,
                 hidden=hidden, heads=heads, ffn=ffn, kv_heads=kv_heads)
    out = []
    for rule in _rules(**sizes):
        if hints and not rule.holds and rule.divisor > 0:
            if rule.what == "head_dim":     # set through hidden: a multiple of 2·heads
                rule = replace(rule, suggest=_valid_values("hidden", hidden, 2 * heads, sizes), suggest_for="hidden",
                               alternative="heads")
            else:
                rule = replace(rule, suggest=_valid_values(rule.what, rule.value, rule.divisor, sizes))
        out.append(rule)
    return out
