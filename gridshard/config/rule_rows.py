"""One config rule's failure as the one-line error every rule gives: the field, its value, the
rule and a fix (:class:`gridshard.errors.ConfigError`)."""
from __future__ import annotations

from ..errors import ConfigError


def fail(field: str, value, rule: str, fix: str):
    raise ConfigError(f"{field}={value!r} is invalid: {rule}. Fix: {fix}.")


def first_broken(rows) -> None:
    """:func:`fail` on the first row ``(field, value, broken, rule, fix)`` whose ``broken`` is true."""
    for field, value, broken, rule, fix in rows:
        if broken:
            fail(field, value, rule, fix)
