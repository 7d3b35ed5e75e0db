"""Does this torch's autograd behave as the copies' backward assumes? Checked once per process.

The copies' backward (segments.py) rests on private parts of torch's autograd:

* a node's ``_set_sequence_nr`` renumbers it (C++ nodes and Python Functions' nodes alike);
* the engine runs, of the nodes that are ready, the one with the highest sequence number first,
  also in a backward called from inside another node's backward (the block's node calls one);
* ``torch._C._current_autograd_node()`` inside a node is that node (each node's copy is read off it).

:func:`reason` runs segments.backward itself, on the CPU, on a tiny graph: two copies of
``x * 2 -> cut -> * w -> cut -> * w`` inside an outer node's backward, and checks the order its
nodes ran in and the copy each was told. A missing attribute or any difference, and forward.py
runs every block as Megatron's with this reason: never the copies in an order nobody checked.
"""

from __future__ import annotations

import functools

import torch

from coc_inject import copy_context
from coc_inject.multi_copy import cuts, scheduler, segments

# (copy, node) in the order the bands run them (segments.renumber); autograd's own order -- the
# latest created first, all of copy 1 before copy 0 -- differs, so renumbering that did nothing shows.
EXPECTED = [(0, "layer 1"), (1, "layer 1"), (0, "cut 2"), (0, "layer 0"), (1, "cut 2"), (1, "layer 0"),
            (0, "cut 1"), (0, "input"), (1, "cut 1"), (1, "input")]


HOOKS_GETTER = "_top_saved_tensors_default_hooks"  # torch._C._autograd's; torch 2.8+ by our reading of its history


def saved_hooks_reason() -> str | None:
    """Why this call cannot run as copies for want of the saved-tensor hooks getter, or None: without it
    (older torch) a copy's thread cannot take on the caller's hooks (activation offloading), so the copies
    run only where none is active."""
    if hasattr(torch._C._autograd, HOOKS_GETTER) or not _hooks_active():
        return None
    return (f"torch {torch.__version__} has no torch._C._autograd.{HOOKS_GETTER}: the copies cannot carry the "
            f"caller's saved-tensor hooks (activation offloading) into their threads")


def _hooks_active() -> bool:
    """A saved tensor already packed by default hooks refuses a second pair (torch's own check)."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        try:
            (x * x).grad_fn._raw_saved_self.register_hooks(lambda t: t, lambda t: t)
        except RuntimeError:
            return True
    return False


@functools.lru_cache(maxsize=None)
def reason() -> str | None:
    """Why the copies cannot run their backward on this torch, or None (checked at the first call)."""
    where = f"the copies' backward cannot rely on this torch's autograd ({torch.__version__}, checked at install)"
    try:
        ran = _run()
    except Exception as error:  # an attribute gone, a signature changed: whatever it is, step aside
        return f"{where}: {type(error).__name__}: {error}"
    order = [(copy, name) for copy, name, _ in ran]
    if order != EXPECTED:
        return f"{where}: it ran renumbered nodes in another order ({order}, not {EXPECTED})"
    told = [(copy, name, seen) for copy, name, seen in ran if seen != copy]
    if told:
        return f"{where}: torch._C._current_autograd_node() did not name the running node ({told})"
    return None


class _Outer(torch.autograd.Function):
    """Runs ``inner`` in its backward: the copies' backward is called from inside the block's node."""

    @staticmethod
    def forward(ctx, x, inner):
        ctx.inner = inner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.inner()
        return grad, None


def _run() -> list:
    """[(copy, node, the copy the code inside that node was told)] in the order the nodes ran."""
    ran = []
    outer, outer_index = copy_context.current(), copy_context.current_copy()
    try:
        with torch.inference_mode(False), torch.enable_grad():
            w = torch.tensor([1.5, -2.0], requires_grad=True)
            pieces = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0, 4.0], requires_grad=True)]
            forward = scheduler.Copies(2)
            forward.cuts = [[], []]
            outputs = []
            for copy, piece in enumerate(pieces):
                copy_context.enter(forward, copy)  # cuts.mark records the calling copy's cuts
                h = piece * 2
                nodes = [("input", h.grad_fn)]
                for layer in range(2):
                    h = cuts.mark(h, cuts.REDUCE)
                    nodes.append((f"cut {layer + 1}", h.grad_fn))
                    h = h * w
                    nodes.append((f"layer {layer}", h.grad_fn))
                for name, node in nodes:
                    node.register_prehook(lambda grads, copy=copy, name=name: ran.append(
                        (copy, name, scheduler.current_copy())))
                outputs.append(h)
            copy_context.leave()

            def inner():
                segments.backward(outputs, [torch.ones(2), torch.ones(2)], pieces, forward.cuts)

            _Outer.apply(torch.zeros(1, requires_grad=True), inner).sum().backward()
    finally:
        if outer is None:
            copy_context.leave()
        else:
            copy_context.enter(outer, outer_index)
    return ran
