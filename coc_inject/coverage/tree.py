"""The live modules without a walk of the heap: every ``torch.nn.Module`` built (or given a child) while
coc-inject is installed, held weakly.

The first-step summary names the counted layers, counts local and Transformer Engine linears and finds
replaced forwards from these instead of ``gc.get_objects()`` (a pass over every live object, ~0.1–0.3 s
in a Megatron process, and the ``gc.collect()`` before it as much again). Complete only where it started
before any Megatron module could exist: from the installation made at Megatron's import by the
bootstrap's hooks (:func:`start`); elsewhere (an install after Megatron's import, a re-install) there is
no tracker and the coverage walks the heap as before.

Seen are the modules whose ``Module.__init__`` ran since (a wrapper on it: ``built``) and every parent
given a child since (torch's global module registration hook, torch >= 2.0). A module built before (a
user's wrapper made before importing Megatron) may have a parent no hook saw: where one heads a called
layer's tree, the coverage walks the heap (``ModelView.inspect``).
"""

from __future__ import annotations

import sys
import weakref

BOOTSTRAP = "coc_inject.bootstrap"  # read through sys.modules: the bootstrap is not this floor's import


class ModuleTracker:
    """Weak references to the modules seen (``live()``), until ``stop()``."""

    def __init__(self):
        self._refs: dict = {}  # id -> weakref.ref (a Module subclass may be unhashable: no WeakSet)
        self._built: set = set()  # ids (of live ones: dropped with the ref) whose Module.__init__ ran since
        self.stop = lambda: None

    def see(self, module, built: bool = False) -> None:
        key = id(module)
        if built:
            self._built.add(key)
        if key in self._refs:
            return
        refs, ids_built = self._refs, self._built

        def gone(ref, key=key):
            if refs.get(key) is ref:
                del refs[key]
                ids_built.discard(key)

        try:
            refs[key] = weakref.ref(module, gone)
        except TypeError:  # not weakly referable: only the heap walk would find it
            self.complete = False

    def built(self, module) -> bool:
        """Was ``module`` built since the tracker started (so every parent it was given was seen)?"""
        return id(module) in self._built and self._refs.get(id(module), lambda: None)() is module

    def live(self) -> list:
        return [module for module in (ref() for ref in list(self._refs.values())) if module is not None]

    complete = True


_started = False  # once per process: a later installation cannot know what was built before it


def start(undo: list) -> ModuleTracker | None:
    """A tracker for the first installation of a process made before Megatron's import (the bootstrap's
    hooks), stopped by ``undo`` (uninstall()); None elsewhere."""
    global _started
    bootstrap = sys.modules.get(BOOTSTRAP)
    if _started or not getattr(bootstrap, "hooked_before_megatron", False):
        return None
    import torch
    from torch.nn.modules import module as torch_module

    register = getattr(torch_module, "register_module_module_registration_hook", None)
    if register is None:
        return None
    _started = True
    tracker = ModuleTracker()
    module_class = torch.nn.Module
    original = module_class.__dict__["__init__"]

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        tracker.see(self, built=True)

    __init__.__wrapped__, __init__.__doc__, __init__.__qualname__ = original, original.__doc__, original.__qualname__

    def registered(parent, name, child):
        tracker.see(parent)
        if child is not None:
            tracker.see(child)
        # None: the child is registered as given

    module_class.__init__ = __init__
    handle = register(registered)

    def stop():
        tracker.complete = False  # from now on modules come and go unseen
        if module_class.__dict__.get("__init__") is __init__:  # else someone patched it since: leave theirs
            module_class.__init__ = original
        handle.remove()

    tracker.stop = stop
    undo.append(stop)
    return tracker
