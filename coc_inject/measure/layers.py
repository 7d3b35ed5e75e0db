"""Which layer a collective belongs to: the innermost module whose forward is running (forward), or
the module whose forward built the running autograd node (backward, a recompute included).

Only while measuring: two global module hooks (outside the measured steps they only count forwards,
and after the last measured or traced step they are removed). The pre-hook pushes the module on the calling
thread's stack (a context variable: multi-copy's copies run in copies of the caller's context); the
hook after the forward pops it and writes the module into the ``metadata`` of every autograd node its
forward built that no inner module claimed (a walk from its outputs, stopped at nodes already
claimed), so a node's backward finds its layer at ``torch._C._current_autograd_node()``. Names are
given at summary time (the modules' qualified names), never per call.
"""

from __future__ import annotations

import contextvars
import weakref

_KEY = "coc_layer"
_WALK_LIMIT = 4096  # nodes per module call: a bound, never reached by a layer's own graph
_stack: contextvars.ContextVar = contextvars.ContextVar("coc_measure_layers", default=())


class Layers:
    """The module hooks of one meter, and the modules they saw (by id, weakly)."""

    def __init__(self, recording=lambda: True):
        self._recording = recording  # only a measured step's modules are stacked and claimed
        self._handles = []
        self.modules: dict = {}  # id -> weakref to the module
        self.forwards = 0  # module calls seen: a step has run a forward since the last optimizer step
        self._named: dict = {}  # id -> name, kept: at exit the model may be gone
        self._looked_up = 0  # modules seen at the last lookup

    def install(self) -> None:
        from torch.nn.modules import module

        self._handles = [module.register_module_forward_pre_hook(self._pre),
                         module.register_module_forward_hook(self._post, always_call=True)]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        self.forwards += 1  # counted every step: the optimizer hook tells a step's end by it
        if not self._recording():
            return
        key = id(module)
        known = self.modules.get(key)
        if known is None or known() is not module:  # new, or a dead module's id reused
            try:
                self.modules[key] = weakref.ref(module)
            except TypeError:
                return
            self._named.pop(key, None)
            self._looked_up = min(self._looked_up, len(self.modules) - 1)
        _stack.set(_stack.get() + (key,))

    def _post(self, module, args, output) -> None:
        stack = _stack.get()
        if not stack or stack[-1] != id(module):
            return
        _stack.set(stack[:-1])
        _claim(output, id(module))

    def current(self, backward: bool):
        """The id of the layer a collective issued now belongs to, or None."""
        if backward:
            import torch

            node = torch._C._current_autograd_node()
            return None if node is None else node.metadata.get(_KEY)
        stack = _stack.get()
        return stack[-1] if stack else None

    def names(self) -> dict:
        """id -> qualified module name ("decoder.layers.0.mlp.linear_fc1"): looked up again (one pass over
        the live objects) only when modules were seen since the last time."""
        if self._looked_up < len(self.modules):
            self._looked_up = len(self.modules)
            self._named.update(self._lookup())
        return self._named

    def _lookup(self) -> dict:
        import gc

        import torch

        from coc_inject.coverage import qualified_name

        parents = {}
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.nn.Module):  # type(): reads no attribute of foreign objects
                for child_name, child in (getattr(obj, "__dict__", {}).get("_modules") or {}).items():
                    if child is not None:
                        parents[id(child)] = (obj, child_name)
        names = {}
        for key, ref in self.modules.items():
            module = ref()
            if module is not None:
                names[key] = qualified_name(module, parents) or type(module).__name__
        return names


def _claim(output, key) -> None:
    import torch

    todo = [t.grad_fn for t in _tensors(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = 0
    while todo and seen < _WALK_LIMIT:
        node = todo.pop()
        seen += 1
        metadata = node.metadata
        if _KEY in metadata:
            continue
        metadata[_KEY] = key
        todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


def _tensors(output):
    if isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
    else:
        yield output
