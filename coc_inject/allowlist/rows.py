"""A row of an allow-list: one Megatron setting, one verdict for one wing, and why.

``IRRELEVANT``: the wing's part never reads it, and it cannot change what the wing computes.
``SUPPORTED``: the wing is exact with it: with any value (``allows`` None), or with the values
``allows`` lists (a tuple, or a predicate ``allows(value, context) -> bool``); another value is refused
with the row's reason. ``REFUSED``: the wing is not exact with it on: a value other than the field's
default (or, with ``allows``, one that ``allows`` does not accept) is refused with the reason.

A predicate's ``context`` is a dict: ``config`` (the whole config) and whatever the wing's guard
passes (``training``, ``kind``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

IRRELEVANT, SUPPORTED, REFUSED = "irrelevant", "supported", "refused"


@dataclass(frozen=True)
class Row:
    name: str
    verdict: str
    why: str
    allows: object = None  # None, a tuple of values, or a predicate (value, context) -> bool

    def accepts(self, value, context: dict) -> bool | None:
        """Whether the row accepts ``value`` (None: the field's default decides, REFUSED without ``allows``)."""
        if self.verdict == IRRELEVANT or (self.verdict == SUPPORTED and self.allows is None):
            return True
        if self.allows is None:
            return None
        if callable(self.allows):
            return bool(self.allows(value, context))
        return any(_same(value, allowed) for allowed in self.allows)


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 (a value whose == does not give one bool)
        return False


def _rows(verdict: str, why: str, names, allows) -> dict:
    return {name: Row(name, verdict, why, allows) for name in names}


def irrelevant(why: str, *names: str) -> dict:
    return _rows(IRRELEVANT, why, names, None)


def supported(why: str, *names: str, allows=None) -> dict:
    return _rows(SUPPORTED, why, names, allows)


def refused(why: str, *names: str, allows=None) -> dict:
    return _rows(REFUSED, why, names, allows)


def table(*groups: dict) -> dict:
    """Groups of rows as one table; a field in two groups of one table is a mistake."""
    merged: dict = {}
    for group in groups:
        twice = set(merged) & set(group)
        assert not twice, f"classified twice in one table: {sorted(twice)}"
        merged.update(group)
    return merged


def off(value, context=None) -> bool:
    """Not switched on: None, False, 0, an empty string or list, 'none'."""
    return not value or value == "none"


def moe_only(value, context) -> bool:
    """For rows that matter only in MoE layers: a model without experts, or the setting off."""
    return not getattr(context["config"], "num_moe_experts", None) or off(value)
