"""Verdicts decided once: what a wing decides from things that do not change between calls (a layer's
class and config, its group sizes, the settings), kept on the layer itself and re-decided only when what
it read changed.

A :class:`Verdict` lives in the owner's ``__dict__`` under a name of the wing's (a plain dict read, no
``nn.Module.__getattr__``), with what it was decided from: the installation (a re-install re-decides),
the config object, the values the decision read of it (``read(config)``: one C call, an
``operator.attrgetter``, compared as a tuple) and any other key (group sizes, ``training``). The
installation remembers every owner it cached on; ``job.uninstall()`` drops them all (:func:`drop`).
"""

from __future__ import annotations

import weakref


class Verdict:
    __slots__ = ("installation", "config", "read", "values", "extra", "value")

    def __init__(self, installation, config, read, extra, value):
        self.installation, self.config, self.read, self.extra, self.value = installation, config, read, extra, value
        self.values = read(config)

    def holds(self, installation, config, extra=None) -> bool:
        """Was this verdict decided for this installation, this config with the same values read, and ``extra``?"""
        return (self.installation is installation and self.config is config and self.extra == extra
                and self.read(config) == self.values)


def remember(installation, owner, name: str, config, read, extra, value) -> Verdict:
    """Keep ``value`` on ``owner`` as ``name``, decided from ``config`` (``read(config)``) and ``extra``."""
    verdict = Verdict(installation, config, read, extra, value)
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
