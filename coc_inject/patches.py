"""Replacing attributes of Megatron's classes and modules, and putting the originals back.

Every hook of an installation patches through one :class:`Patches`: it records the attribute's
original the first time it is replaced, so a hook that patches again wraps the original (never
its own wrapper), and :meth:`Patches.restore` puts every original back.
"""

from __future__ import annotations


class Patches:
    def __init__(self):
        self._originals: dict = {}  # (owner, attribute name) -> original

    def original(self, owner, name: str):
        """The attribute as it was before the first patch (a class's own ``__dict__`` entry)."""
        found = self._originals.get((owner, name), _absent)
        if found is not _absent:
            return found
        return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

    def patch(self, owner, name: str, replacement) -> None:
        self._originals.setdefault((owner, name), self.original(owner, name))
        setattr(owner, name, replacement)

    def restore(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()

    def patched(self) -> list:
        """(owner, name) of every attribute patched now."""
        return list(self._originals)

    def __bool__(self) -> bool:
        return bool(self._originals)


_absent = object()
