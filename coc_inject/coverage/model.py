"""The model as the coverage sees it: one pass over the live ``torch.nn.Module`` objects (the tracked
ones of coverage/tree.py at the first step where it can, else the heap's).

Done at summary / report time only, never per call: it names the counted layers by their
qualified module name (leading ``module.`` wrappers of DDP / Float16Module dropped), counts
Megatron's local and Transformer Engine's tensor-parallel linears, finds patched forwards
that someone else replaced since install(), and counts modules left half-built by a failed
construction (skipped: they have no children to walk).
"""

from __future__ import annotations

import gc
import warnings

# Tensor-parallel linear classes of Megatron's Transformer Engine spec: none subclasses the
# local layers, so CoC never sees their calls.
TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine.")
TE_CLASSES = frozenset((
    "TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear",
    "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear", "TELMHeadColumnParallelLinear",
))


def is_foreign_linear(module) -> bool:
    cls = type(module)
    return cls.__name__ in TE_CLASSES and cls.__module__.startswith(TE_MODULES)


class ModelView:
    """What the last pass saw; at exit the model may be gone, so the largest picture is kept."""

    def __init__(self, patched_forwards: dict):
        self.patched_forwards = patched_forwards  # class -> the forward install() put there
        self.foreign_layers: dict[str, int] = {}
        self.replaced: dict[str, str] = {}  # class name -> module.qualname of the forward now in place
        self.local_layers = 0
        # class name -> modules whose __init__ failed before torch's Module.__init__ (no _modules): a layer
        # whose construction raised, kept alive by the traceback until exit.
        self.half_built: dict[str, int] = {}

    def inspect(self, records, tracker=None) -> None:
        """Name the live layers of ``records``; count local and TE layers; find replaced forwards. From
        ``tracker``'s modules where it is complete (coverage/tree.py), else from a pass over the heap."""
        scan = None
        if tracker is not None and tracker.complete:
            scan = _Scan(tuple(self.patched_forwards), tracker.live())
            if not scan.all_counted_under(records, tracker):
                scan = None  # a counted layer outside the called ones' trees (garbage?), or a tree's head unknown
        if scan is None:
            gc.collect()  # layers that are garbage must not count (once per summary / report)
            scan = _Scan(tuple(self.patched_forwards), gc.get_objects())
        for record in records:
            layer = record.layer()
            if layer is not None:
                record.name = qualified_name(layer, scan.parents) or record.name
        for name, count in scan.foreign.items():
            self.foreign_layers[name] = max(count, self.foreign_layers.get(name, 0))
        self.local_layers = max(len(scan.local), self.local_layers)
        for name, count in scan.half_built.items():
            self.half_built[name] = max(count, self.half_built.get(name, 0))
        self.replaced = {cls.__name__: _origin(cls.__dict__.get("forward"))
                         for cls, ours in self.patched_forwards.items() if cls.__dict__.get("forward") is not ours}


class _Scan:
    """One pass over ``objects``: the modules' parents, the local and TE layers, the half-built modules."""

    def __init__(self, local_classes: tuple, objects):
        import torch

        self.parents: dict = {}  # id(child) -> (parent, name)
        self.local: list = []
        self.foreign_modules: list = []
        self.foreign: dict[str, int] = {}
        self.half_built: dict[str, int] = {}
        # type(obj) reads no attribute of the object: isinstance() would read a foreign object's
        # __class__, which some objects warn about (torch.distributed.reduce_op: a FutureWarning
        # in every job). Whatever else a walked object says is not the user's business either.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in objects:
                cls = type(obj)
                if not issubclass(cls, torch.nn.Module):
                    continue
                children = getattr(obj, "__dict__", {}).get("_modules")  # never Module.__getattr__
                if children is None:
                    self.half_built[cls.__name__] = self.half_built.get(cls.__name__, 0) + 1
                    continue
                for child_name, child in children.items():
                    if child is not None:
                        self.parents[id(child)] = (obj, child_name)
                if issubclass(cls, local_classes):
                    self.local.append(obj)
                elif is_foreign_linear(obj):
                    self.foreign[cls.__name__] = self.foreign.get(cls.__name__, 0) + 1
                    self.foreign_modules.append(obj)

    def root(self, module):
        seen = set()
        while id(module) in self.parents and id(module) not in seen:
            seen.add(id(module))
            module = self.parents[id(module)][0]
        return module

    def all_counted_under(self, records, tracker) -> bool:
        """Is every counted layer in the module tree of a layer that was called (``records``)? Without a
        gc.collect() a layer of a model dropped in a reference cycle is still seen: one outside the trees
        of the called layers (a standalone layer, a dropped model never called) asks for the collect.
        (A model called and then dropped in a cycle before the first step would count: its layers ran.) A
        tree headed by a module built before the tracker started may go on above it, unseen: walk too."""
        roots = set()
        for record in records:
            layer = record.layer()
            if layer is not None:
                root = self.root(layer)
                if not tracker.built(root):
                    return False  # built before the tracker: it may have a parent no hook saw
                roots.add(id(root))
        return all(id(self.root(module)) in roots for module in (*self.local, *self.foreign_modules))


def _origin(function) -> str:
    if function is None:
        return "nothing (forward deleted)"
    module = getattr(function, "__module__", None) or type(function).__module__
    return f"{module}.{getattr(function, '__qualname__', type(function).__name__)}"


def qualified_name(layer, parents: dict) -> str | None:
    parts = []
    node = layer
    seen = set()
    while id(node) in parents and id(node) not in seen:
        seen.add(id(node))
        node, name = parents[id(node)]
        parts.append(name)
    if not parts:
        return None
    parts.reverse()
    while len(parts) > 1 and parts[0] == "module":  # DDP / Float16Module wrappers
        parts.pop(0)
    return ".".join(parts)
