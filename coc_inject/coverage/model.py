"""The model as the coverage sees it: one pass over the live ``torch.nn.Module`` objects.

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

    def inspect(self, records) -> None:
        """Name the live layers of ``records``; count local and TE layers; find replaced forwards."""
        import torch

        local_classes = tuple(self.patched_forwards)
        parents = {}
        foreign: dict[str, int] = {}
        half_built: dict[str, int] = {}
        local = 0
        gc.collect()  # layers that are garbage must not count (once per summary / report)
        # type(obj) reads no attribute of the object: isinstance() would read a foreign object's
        # __class__, which some objects warn about (torch.distributed.reduce_op: a FutureWarning
        # in every job). Whatever else a walked object says is not the user's business either.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                cls = type(obj)
                if not issubclass(cls, torch.nn.Module):
                    continue
                children = getattr(obj, "__dict__", {}).get("_modules")  # never Module.__getattr__
                if children is None:
                    half_built[cls.__name__] = half_built.get(cls.__name__, 0) + 1
                    continue
                for child_name, child in children.items():
                    if child is not None:
                        parents[id(child)] = (obj, child_name)
                if issubclass(cls, local_classes):
                    local += 1
                elif is_foreign_linear(obj):
                    foreign[cls.__name__] = foreign.get(cls.__name__, 0) + 1
        for record in records:
            layer = record.layer()
            if layer is not None:
                record.name = qualified_name(layer, parents) or record.name
        for name, count in foreign.items():
            self.foreign_layers[name] = max(count, self.foreign_layers.get(name, 0))
        self.local_layers = max(local, self.local_layers)
        for name, count in half_built.items():
            self.half_built[name] = max(count, self.half_built.get(name, 0))
        self.replaced = {cls.__name__: _origin(cls.__dict__.get("forward"))
                         for cls, ours in self.patched_forwards.items() if cls.__dict__.get("forward") is not ours}


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
