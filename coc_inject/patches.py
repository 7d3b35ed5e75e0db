"""Replacing attributes of Megatron's classes and modules, and putting the originals back.

Every hook of an installation patches through one :class:`Patches`: it records the attribute's
original the first time it is replaced, so a hook that patches again wraps the original (never
its own wrapper), and :meth:`Patches.restore` puts every original back -- where the attribute is
still coc-inject's. One that another patcher replaced since (MindSpeed's adaptor sets its own over
Megatron's after importing the module, i.e. after coc-inject's hook) holds coc-inject's wrapper
inside its own: putting Megatron's original there would silently take the other tool's patch away,
so it is left in place and named.
"""

from __future__ import annotations


class Patches:
    def __init__(self):
        self._originals: dict = {}  # (owner, attribute name) -> original
        self._ours: dict = {}  # (owner, attribute name) -> what coc-inject put there last

    def original(self, owner, name: str):
        """The attribute as it was before the first patch (a class's own ``__dict__`` entry)."""
        found = self._originals.get((owner, name), _absent)
        if found is not _absent:
            return found
        return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

    def patch(self, owner, name: str, replacement) -> None:
        self._originals.setdefault((owner, name), self.original(owner, name))
        self._ours[(owner, name)] = replacement
        setattr(owner, name, replacement)

    def restore(self) -> list:
        """Every original put back where coc-inject's replacement is still in place; returns
        ``(owner, name, what is there now)`` of those another patcher replaced since, left as they are."""
        left = []
        for key, original in self._originals.items():
            owner, name = key
            now = _current(owner, name)
            if now is self._ours[key]:
                setattr(owner, name, original)
            else:
                left.append((owner, name, now))
        self._originals.clear()
        self._ours.clear()
        return left

    def patched(self) -> list:
        """(owner, name) of every attribute patched now."""
        return list(self._originals)

    def __bool__(self) -> bool:
        return bool(self._originals)


def _current(owner, name: str):
    return owner.__dict__.get(name, _absent) if isinstance(owner, type) else getattr(owner, name, _absent)


def describe(owner, name: str, now) -> str:
    """"RowParallelLinear.forward (now: mindspeed.core....wrapper)" for a line about an attribute left in place."""
    where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
    what = "nothing" if now is _absent else \
        f"{getattr(now, '__module__', None) or '?'}.{getattr(now, '__qualname__', type(now).__name__)}"
    return f"{where}.{name} (now: {what})"


_absent = object()
