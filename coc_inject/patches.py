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
        self._patched: dict = {}  # (owner, attribute name) -> (original, what coc-inject put there last)

    def original(self, owner, name: str):
        """The attribute as it was before the first patch (a class's own ``__dict__`` entry)."""
        found = self._patched.get((owner, name))
        if found is not None:
            return found[0]
        return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

    def patch(self, owner, name: str, replacement) -> None:
        self._patched[(owner, name)] = (self.original(owner, name), replacement)
        setattr(owner, name, replacement)

    def patch_over(self, owner, name: str, replacement) -> None:
        """Patch what another patcher set since coc-inject's patch (a replacement coc-inject reads, like
        MindSpeed's block forward): that becomes the original :meth:`restore` puts back, so the other
        patcher's choice stays when coc-inject leaves."""
        self._patched[(owner, name)] = (_current(owner, name), replacement)
        setattr(owner, name, replacement)

    def restore(self) -> list:
        """Every original put back where coc-inject's replacement is still in place; returns
        :meth:`taken_over`'s rows, the attributes another patcher set since, left as they are."""
        left = self.taken_over()
        kept = {(owner, name) for owner, name, _, _ in left}
        for (owner, name), (original, _) in self._patched.items():
            if (owner, name) not in kept:
                setattr(owner, name, original)
        self._patched.clear()
        return left

    def taken_over(self) -> list:
        """``(owner, name, what is there now, ours_still_runs)`` of each attribute another patcher set after
        coc-inject's patch; ``ours_still_runs``: what is there wraps coc-inject's (its ``__wrapped__`` chain,
        as ``functools.wraps`` leaves it, reaches it), else coc-inject's patch does not run there."""
        found = []
        for (owner, name), (_, ours) in self._patched.items():
            now = _current(owner, name)
            if now is not ours:
                found.append((owner, name, now, _wraps(now, ours)))
        return found

    def patched(self) -> list:
        """(owner, name) of every attribute patched now."""
        return list(self._patched)

    def __bool__(self) -> bool:
        return bool(self._patched)


def _wraps(outer, inner) -> bool:
    for _ in range(64):  # a chain of wrappers, never a cycle
        if outer is inner:
            return True
        outer = getattr(outer, "__wrapped__", None)
        if outer is None:
            return False
    return False


def _current(owner, name: str):
    return owner.__dict__.get(name, _absent) if isinstance(owner, type) else getattr(owner, name, _absent)


def attribute_name(owner, name: str) -> str:
    """"RowParallelLinear.forward", "parallel_state.initialize_model_parallel" (a module by its last name)."""
    where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
    return f"{where.rsplit('.', 1)[-1] if not isinstance(owner, type) else where}.{name}"


def object_name(obj) -> str:
    """Where an attribute's value comes from: "module.qualname" ("nothing" for a deleted attribute)."""
    if obj is _absent:
        return "nothing"
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def describe(owner, name: str, now) -> str:
    """"RowParallelLinear.forward (now: mindspeed.core....wrapper)" for a line about an attribute left in place."""
    return f"{attribute_name(owner, name)} (now: {object_name(now)})"


_absent = object()
