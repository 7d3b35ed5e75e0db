"""The checker: :func:`refusal` (why a wing must leave this config's layer, call or block to Megatron,
or None), the tables per wing, and :func:`unclassified` (what the tests hold at nothing).

A field's default is the dataclass field's (``default``, or ``default_factory()``; Megatron's where a subclass
redeclares it); a field only a subclass of Megatron's config declares is not read by Megatron's layers and
goes unchecked, and a subclass overriding what the layers call is refused (subclasses.py); a field whose
value ``__post_init__`` derives (``ffn_hidden_size``, ``kv_channels``, ``init_method``,
``recompute_modules``, ...) is classified explicitly by every wing, so its default never decides.
The checks are compiled once per config class and wing: a call reads only the rows that can refuse.
"""

from __future__ import annotations

import dataclasses
import operator

from coc_inject.allowlist import common, context_parallel, linears, moe, multi_copy, subclasses
from coc_inject.allowlist.rows import IRRELEVANT, REFUSED, SUPPORTED, off

LINEARS, CONTEXT_PARALLEL, MULTI_COPY, SEQUENCE_COPIES, MOE = (
    "linears", "context_parallel", "multi_copy", "sequence_copies", "moe")


@dataclasses.dataclass(frozen=True)
class Wing:
    name: str
    label: str  # as a reason names it: "... is refused by <label>"
    fallback: str  # what an unclassified field leads to
    rows: dict


WINGS = {wing.name: wing for wing in (
    Wing(LINEARS, "the linears wing", "running Megatron's path", {**common.ROWS, **linears.ROWS}),
    Wing(CONTEXT_PARALLEL, "context-parallel attention", "coc-inject cannot vouch for it",
         {**common.ROWS, **context_parallel.ROWS}),
    Wing(MULTI_COPY, "multi-copy", "running Megatron's block", {**common.ROWS, **multi_copy.ROWS}),
    Wing(SEQUENCE_COPIES, "sequence copies", "running Megatron's block",
         {**common.ROWS, **multi_copy.ROWS, **multi_copy.SEQUENCE_ROWS}),
    Wing(MOE, "the MoE pieces", "running Megatron's dispatcher", {**common.ROWS, **moe.ROWS}),
)}

_MISSING = dataclasses.MISSING
_compiled: dict = {}  # (config class, wing) -> (what a subclass overrides or None, ((name, row or None, default), ...))


def refusal(config, wing: str, **context) -> str | None:
    """Why ``wing`` must leave this config's layer, call or block to Megatron (naming the field), or None.

    ``context`` goes to the rows' predicates (``training``, ``kind``, ...); ``values`` (a dict) gives a
    field's value where the layer's own argument overrides the config's (``attention_dropout``)."""
    values = context.pop("values", None) or {}
    context["config"] = config
    spec = WINGS[wing]
    overridden, checks = _checks(type(config), spec)
    if overridden is not None:
        return (f"{type(config).__name__} overrides what Megatron's layers call on their config ({overridden}) "
                f"and is refused by {spec.label}: {spec.fallback}")
    for name, row, default in checks:
        value = values[name] if name in values else getattr(config, name, _MISSING)
        if value is _MISSING:
            continue
        accepted = None if row is None else row.accepts(value, context)
        if accepted is None:
            accepted = _is_default(value, default)
        if accepted:
            continue
        shown = f"{name}={_short(value)}"
        if row is None:
            return f"{shown} is not classified for {spec.label}: {spec.fallback}"
        return f"{shown} is refused by {spec.label}: {row.why}"
    return None


# What rows' predicates read of ``context["config"]`` beyond their own field (rows.moe_only).
READ_BY_PREDICATES = ("num_moe_experts",)
_readers: dict = {}  # (config class, wing) -> reads()


def read_names(cls, wing: str) -> tuple:
    """The fields :func:`refusal` reads of a ``cls`` config for ``wing``: those that can refuse, and what the
    rows' predicates read."""
    names = tuple(name for name, _, _ in _checks(cls, WINGS[wing])[1])
    return names + tuple(name for name in READ_BY_PREDICATES if name not in names)


def reader(cls, names: tuple):
    """``config -> tuple`` of ``names``' values: one C call (``operator.attrgetter``) where ``cls`` is a
    dataclass defining them all; a stand-in config's absent field reads as a marker."""
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if names and set(names) <= fields:
        getter = operator.attrgetter(*names)
        return getter if len(names) > 1 else (lambda config: (getter(config),))
    return lambda config: tuple(getattr(config, name, _MISSING) for name in names)


def reads(cls, wing: str):
    """``config -> tuple``: the values :func:`refusal` reads of a ``cls`` config for ``wing`` (read_names), one
    C call: a verdict cached on a layer (coc_inject.verdicts) is keyed by them, so a later change of any of
    them decides afresh."""
    key = (cls, wing)
    found = _readers.get(key)
    if found is None:
        found = _readers[key] = reader(cls, read_names(cls, wing))
    return found


def _checks(cls, spec: Wing) -> tuple:
    key = (cls, spec.name)
    found = _compiled.get(key)
    if found is None:
        checks, overridden = [], None
        if dataclasses.is_dataclass(cls):
            megatron = subclasses.megatron_fields(cls)
            overridden = None if megatron is None else subclasses.overridden(cls, megatron)
            for field in dataclasses.fields(cls):
                row = spec.rows.get(field.name)
                if megatron is not None and row is None and not subclasses.read_by_megatron(field.name, megatron):
                    continue  # a subclass's own field (Megatron-Bridge's seq_length, ...): no layer reads it
                if row is None or row.verdict == REFUSED or (row.verdict == SUPPORTED and row.allows is not None):
                    checks.append((field.name, row, _default((megatron or {}).get(field.name, field))))
        else:  # a stand-in config (not Megatron's dataclass): the rows that can refuse, by attribute
            checks = [(name, row, _MISSING) for name, row in spec.rows.items()
                      if row.verdict != IRRELEVANT and not (row.verdict == SUPPORTED and row.allows is None)]
        found = _compiled[key] = (overridden, tuple(checks))
    return found


def _default(field):
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return _MISSING


def _is_default(value, default) -> bool:
    if default is _MISSING:  # no default (or a stand-in config): off is the default
        return off(value)
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001
        return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def classification(wing: str, name: str):
    """The row classifying ``name`` for ``wing``, or None."""
    return WINGS[wing].rows.get(name)


def unclassified(names, wing: str) -> list:
    """The names no row of ``wing`` classifies (a test holds this at nothing for every release)."""
    return sorted(name for name in names if name not in WINGS[wing].rows)
