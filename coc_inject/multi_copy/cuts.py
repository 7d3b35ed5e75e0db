"""Cut points: where a copy's backward can stop with its last collective in flight.

A copy's forward marks the input of every node whose backward *ends* in a collective:

* ``REDUCE``: a column-parallel linear's input; its backward ends in the input gradient's
  all-reduce (reduce-scatter with sequence parallelism), Megatron's or CoC's chunked one;
* ``GATHER``: with sequence parallelism, the input of the row-parallel linear's reduce-scatter
  mapping; its backward all-gathers the gradient.

The mark is an identity autograd node (:class:`Cut`) whose sequence number splits the copy's
graph into segments (segments.py). Marks are program points of the copies, the same on every rank;
they are recorded only in a copy's forward with grad on (a recompute's forward, under no grad or
inside the backward, records none).

A sequence-parallel column linear's backward also all-gathers its input again (for the weight
gradient) and waits for it inside the same node: its cut keeps that input (:class:`CutPoint`), so
the copies' backward can issue the gather earlier, at the start of the copy's band (segments.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from coc_inject import copy_context

REDUCE = "reduce"
GATHER = "gather"
# The torch.distributed collectives of each kind (what a deferred wait may be, after a cut of that kind).
KINDS = {"all_reduce": REDUCE, "reduce_scatter": REDUCE, "reduce_scatter_tensor": REDUCE, "_reduce_scatter_base": REDUCE,
         "reduce_scatter_single": REDUCE, "all_gather": GATHER, "all_gather_into_tensor": GATHER,
         "_all_gather_base": GATHER, "all_gather_single": GATHER}  # *_single: the chunked linears' forms
# Megatron's row-parallel reduce-scatter mapping, by the module alias its RowParallelLinear calls.
GATHER_MAPPING = ("megatron.core.tensor_parallel.layers", "reduce_scatter_to_sequence_parallel_region")
_INPUT_NAMES = ("input_", "input", "x", "hidden_states")


class Cut(torch.autograd.Function):
    """Identity; its node marks a cut point in the graph. Its backward first has the copies' run
    complete the copy's collectives left in flight by the node before it (segments.py)."""

    @staticmethod
    def forward(ctx, x, copy):
        ctx.copy = copy
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        run = copy_context.current()
        if run is not None:
            starting = getattr(run, "start_band", None)  # the copies' backward: the band's gathers first
            if starting is not None:
                starting(ctx)  # ctx is this node
            run.complete(ctx.copy)
        return grad, None


class CutPoint(tuple):
    """``(sequence number, node, kind)`` of one cut; ``.input``: the marked tensor where the node
    after it may gather it again in its backward (a sequence-parallel column linear's), else None."""

    input = None


def mark(x, kind: str, gathered: bool = False):
    """``x`` through a :class:`Cut` recorded for the calling copy, when its forward records cuts
    (``gathered``: the next node may all-gather ``x`` in its backward: the cut keeps it)."""
    run = copy_context.current()
    cuts = getattr(run, "cuts", None)
    if cuts is None or not isinstance(x, torch.Tensor) or not x.requires_grad or not torch.is_grad_enabled():
        return x
    copy = copy_context.current_copy()
    marked = Cut.apply(x, copy)
    point = CutPoint((marked.grad_fn._sequence_nr(), marked.grad_fn, kind))
    if gathered:
        point.input = marked  # saved by the linear as well: no memory of its own
    cuts[copy].append(point)
    return marked


def is_column_parallel(module) -> bool:
    """A column-parallel linear whose input goes straight to its matmul (a fused layer norm in front,
    as TE's, reads the reduced gradient inside the same node: it is not cut)."""
    return _column_class(type(module))


@functools.lru_cache(maxsize=None)  # a block call walks every module: decided once per class
def _column_class(cls) -> bool:
    names = [base.__name__ for base in cls.__mro__]
    return any("ColumnParallelLinear" in name for name in names) and not any("LayerNorm" in name for name in names)


def _mark_column_input(module, args, kwargs):
    gathered = bool(getattr(module, "sequence_parallel", False))
    if args:
        return (mark(args[0], REDUCE, gathered), *args[1:]), kwargs
    for name in _INPUT_NAMES:
        if name in kwargs:
            return args, dict(kwargs, **{name: mark(kwargs[name], REDUCE, gathered)})
    return None


@contextlib.contextmanager
def marking(block):
    """The block's column-parallel linears mark their inputs while inside (forward pre-hooks, removed
    on the way out: nothing stays on the model)."""
    handles = [module.register_forward_pre_hook(_mark_column_input, with_kwargs=True)
               for module in block.modules() if is_column_parallel(module)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def marking_gather_mapping(original):
    """Megatron's row-parallel reduce-scatter mapping with its input marked (a GATHER cut)."""

    def reduce_scatter_to_sequence_parallel_region(input_, *args, **kwargs):
        return original(mark(input_, GATHER), *args, **kwargs)

    reduce_scatter_to_sequence_parallel_region.__wrapped__ = original
    return reduce_scatter_to_sequence_parallel_region
