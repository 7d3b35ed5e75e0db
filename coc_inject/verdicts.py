"""Verdicts decided once: what a wing decides from things that do not change between calls (a layer's
class and config, its group sizes, the settings), kept on the layer itself and re-decided only when what
it read changed.

A :class:`Verdict` lives in the owner's ``__dict__`` under a name of the wing's (a plain dict read, no
``nn.Module.__getattr__``), with what it was decided from: the installation (a re-install re-decides),
the config object, the values the decision read of it (``read(config)``: one C call, an
``operator.attrgetter``, compared as a tuple) and any other key (group sizes, ``training``). The
installation remembers every owner it cached on; ``job.uninstall()`` drops them all (:func:`drop`).

Re-reading the values on every call costs ~50 attribute reads (a block's verdict): instead the config's
class is watched while installed (:func:`watch`: its ``__setattr__`` counts every set, ``_changes``), and a
verdict re-reads its values only when that count moved since it last did: a call costs one int compare.
"""

from __future__ import annotations

import weakref


_changes = 0  # attributes set on watched config objects since import (watch()); only its moves matter


class Verdict:
    __slots__ = ("installation", "config", "read", "values", "extra", "value", "seen")

    def __init__(self, installation, config, read, extra, value, watched: bool = False):
        self.installation, self.config, self.read, self.extra, self.value = installation, config, read, extra, value
        self.seen = _changes if watched else None  # None: not watched, the values are re-read on every call
        self.values = read(config)

    def holds(self, installation, config, extra=None) -> bool:
        """Was this verdict decided for this installation, this config with the same values read, and ``extra``?"""
        if self.installation is not installation or self.config is not config or self.extra != extra:
            return False
        if self.seen == _changes:
            return True  # no attribute of a watched config was set since the values were last read
        if self.read(config) != self.values:
            return False
        if self.seen is not None:
            self.seen = _changes
        return True


def _counting(setattr_):
    def __setattr__(self, name, value):
        global _changes
        _changes += 1
        setattr_(self, name, value)

    __setattr__.coc_counts_sets = True
    __setattr__.__wrapped__ = setattr_  # what the class's objects set through (allowlist.subclasses reads it)
    return __setattr__


def watch(installation, cls) -> bool:
    """Count every attribute set on a ``cls`` object (``_changes``) until ``installation`` is uninstalled; False
    where it cannot (no ``undo`` to take it back, a built-in class): its verdicts re-read on every call."""
    current = cls.__setattr__
    if getattr(current, "coc_counts_sets", False):
        return True  # this class or a base already counts (through whatever a subclass's __setattr__ calls)
    undo = getattr(installation, "undo", None)
    if undo is None:
        return False
    own = cls.__dict__.get("__setattr__")
    try:
        cls.__setattr__ = _counting(current)
    except TypeError:
        return False
    counting = cls.__dict__["__setattr__"]

    def unwatch():
        if cls.__dict__.get("__setattr__") is counting:  # else someone set theirs since: leave it
            if own is None:
                delattr(cls, "__setattr__")
            else:
                cls.__setattr__ = own

    undo.append(unwatch)
    return True


def remember(installation, owner, name: str, config, read, extra, value) -> Verdict:
    """Keep ``value`` on ``owner`` as ``name``, decided from ``config`` (``read(config)``) and ``extra``."""
    watched = read is nothing or (config is not None and watch(installation, type(config)))
    verdict = Verdict(installation, config, read, extra, value, watched)
    owner.__dict__[name] = verdict
    owners = getattr(installation, "verdict_owners", None)
    if owners is not None:
        owners.setdefault(name, weakref.WeakSet()).add(owner)
    return verdict


def drop(owners: dict) -> None:
    """Forget every verdict kept on the owners (``{name: WeakSet of owners}``): uninstall()."""
    for name, kept_on in owners.items():
        for owner in list(kept_on):
            if owner.__dict__.get(name) is not None:
                del owner.__dict__[name]
    owners.clear()


def nothing(config) -> tuple:
    """``read`` for a verdict that reads nothing of its config but its identity."""
    return ()
