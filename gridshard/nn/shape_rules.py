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

from dataclasses import dataclass, replace

from ..job_layout import TensorMode


# the size each rule is about -> the keyword of model_shape_rules that sets it
_FIELD_ARGS = {"hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "ffn_hidden": "ffn",
               "seq_len": "seq", "micro_batch": "batch"}


@dataclass(frozen=True)
class DivisibilityRule:
    """``value`` (the size called ``what``) must be a multiple of ``divisor`` (called ``by``;
    a plain number such as ``"2"`` when the divisor is a constant).

    ``suggest`` / ``suggest_for``: values of the size ``suggest_for`` (default ``what``) near
    the current one that fix every rule about that size and break none that held, the other
    sizes unchanged (filled in by :func:`model_shape_rules` for broken rules), so a fix never
    trades one broken rule for another. ``head_dim`` is not set directly: its fix names ``hidden``
    (``alternative``: another size the fix may change instead)."""

    what: str
    value: int
    divisor: int
    by: str
    why: str
    suggest: tuple = ()
    suggest_for: str = ""
    alternative: str = ""

    @property
    def holds(self) -> bool:
        return self.divisor > 0 and self.value % self.divisor == 0

    def message(self) -> str:
        constant = self.by == str(self.divisor)
        by = self.by if constant else f"{self.by}={self.divisor}"
        field = self.suggest_for or self.what
        fixes = [f"use {field} in {list(self.suggest)}"] if self.suggest else []
        if not constant:
            fixes.append(f"change {self.by}")
        if self.alternative:
            fixes.append(f"change {self.alternative}")
        fix = " or ".join(fixes) or f"change {field}"
        return f"{self.what}={self.value} is not divisible by {by}: {self.why}. Fix: {fix}."


def layout_rules(mode, tensor: int, hidden: int, heads: int, ffn: int, kv_heads=None) -> list:
    """The rules a model's dimensions must meet to be laid out in ``mode`` on ``tensor`` ranks,
    whatever its batch and sequence: grouped-query attention, then the mode's splits (module
    docstring). The one list of them: the config validator reads it through
    :func:`model_shape_rules`, ``parallelize`` through :func:`gridshard.parallel.check_layout`."""
    kv_heads = kv_heads or heads
    mode = TensorMode.parse(mode)
    rules = [DivisibilityRule("heads", heads, kv_heads, "kv_heads", "each kv head serves a whole group of heads")]
    if mode.is_1d:
        why = "1D tensor parallelism gives every rank whole heads and whole MLP neurons"
        rules += [DivisibilityRule("heads", heads, tensor, "tensor", why),
                  DivisibilityRule("ffn_hidden", ffn, tensor, "tensor", why),
                  DivisibilityRule("hidden", hidden, tensor, "tensor", why)]
        if kv_heads % tensor and tensor % kv_heads:
            rules.append(DivisibilityRule("kv_heads", kv_heads, tensor, "tensor",
                                          "kv heads are split over T (T divides them) or replicated in groups "
                                          "(they divide T)"))
    elif mode.is_grid:
        q = mode.grid_side(tensor)
        why = "2D tensor parallelism splits the projection widths into q blocks (q = sqrt(tensor))"
        rules += [DivisibilityRule("hidden", hidden, q * q, "q²",
                                   "2D norm weights (like Linear2D biases) are stored in q² blocks"),
                  DivisibilityRule("heads", heads, q, "q", why),
                  DivisibilityRule("ffn_hidden", ffn, q, "q", why),
                  DivisibilityRule("kv_heads", kv_heads, q, "q", why)]
    elif mode.is_cube:
        q = mode.cube_side(tensor)
        why = "3D tensor parallelism gives every rank 1/q of the heads (q = cube root of tensor)"
        rules += [DivisibilityRule("hidden", hidden, q ** 3, "q³",
                                   "3D norm weights (like Linear3D biases) are stored in q³ blocks"),
                  DivisibilityRule("heads", heads, q, "q", why),
                  DivisibilityRule("ffn_hidden", ffn, q * q, "q²",
                                   "3D splits the down projection's input (ffn_hidden) into q² blocks"),
                  DivisibilityRule("kv_heads", kv_heads, q, "q", why)]
    return rules


def _rules(mode: str, tensor: int, sequence_parallel: bool, batch: int, seq: int, hidden: int, heads: int,
           ffn: int, kv_heads=None) -> list:
    mode = TensorMode.parse(mode)
    gqa, *splits = layout_rules(mode, tensor, hidden, heads, ffn, kv_heads)
    rules = [DivisibilityRule("hidden", hidden, heads, "heads", "every head needs hidden/heads channels"), gqa]
    if heads > 0 and hidden % heads == 0:
        rules.append(DivisibilityRule("head_dim", hidden // heads, 2, "2",
                                      "rotary embeddings rotate channel pairs (head_dim = hidden/heads)"))
    rules += splits
    if mode.is_1d and sequence_parallel:
        rules.append(DivisibilityRule("seq_len", seq, tensor, "tensor",
                                      "sequence parallelism splits the residual stream along the sequence"))
    elif mode.is_grid:
        rules.append(DivisibilityRule("micro_batch", batch, mode.grid_side(tensor), "q",
                                      "2D tensor parallelism splits each micro-batch over the q grid rows"))
    elif mode.is_cube:
        rules.append(DivisibilityRule("micro_batch", batch, mode.cube_side(tensor) ** 2, "q²",
                                      "3D tensor parallelism splits each micro-batch into q² batch blocks"))
    return rules


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
