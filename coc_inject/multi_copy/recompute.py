"""Full recompute with copies: the recomputed forward runs as copies too, its cuts recorded, and each
recomputed stretch's backward runs in bands (segments.py) like a block without recompute.

Megatron's full recompute (``--recompute-granularity full``, methods ``uniform`` and ``block``)
runs chunks of layers through ``tensor_parallel.checkpoint``: the chunk's forward under no grad, and
in the backward, per chunk, the forward again and a backward of its own. Inside a copy that
backward would run one copy's chunk at a time, the copies' collectives in turn. So inside a copies'
forward that records cuts, :func:`checkpoint` takes the call instead: the chunk's forward runs under
no grad as Megatron's does (each copy's RNG state kept for its recompute), and its output becomes a
leaf of the copy's graph (:class:`Chunk` records how to recompute it). The block's backward
(:func:`backward`) then goes from the block's output back, one stretch at a time, every copy at once:

* the stretch from the block's output to the last chunk's output (the final layer norm, with the
  ``block`` method the layers not recomputed, their cuts from the forward): in bands;
* per chunk, last first: the chunk's forward again for every copy, as copies taking turns on
  threads (scheduler.CopyRun, as the block's forward: the recomputed forward's collectives overlap
  too), its cuts recorded; then that stretch's backward in bands, into the chunk's input;
* the stretch from the first chunk's input back to the block's input, where there is one.

The copies' threads only compute forward ops; autograd's own calls stay on the thread that runs the
block's node. Every collective is issued at a program point of a copy: the same order on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from coc_inject import copy_context, rng_state
from coc_inject.multi_copy import collectives, cuts, scheduler, segments

CHECKPOINT = ("megatron.core.tensor_parallel", "checkpoint")  # what Megatron's blocks call per chunk


@dataclass
class Chunk:
    """One copy's checkpointed chunk: ``function(*args)`` recomputes it from the RNG state ``rng``;
    ``output`` is the leaf the copy's graph goes on from (the chunk's first output)."""

    function: object
    args: tuple
    rng: tuple
    output: torch.Tensor


def recording_run():
    """The copies' forward run recording chunks here, or None (then Megatron's checkpoint runs)."""
    run = copy_context.current()
    return run if getattr(run, "chunks", None) is not None else None


def checkpoint(original):
    """Megatron's ``tensor_parallel.checkpoint`` taken over inside a copies' forward (module docstring)."""

    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        run = recording_run()
        hidden = args[0] if args else None
        if (run is None or distribute_saved_activations or not isinstance(hidden, torch.Tensor)
                or not hidden.requires_grad or not torch.is_grad_enabled()
                or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:])):
            return original(function, distribute_saved_activations, *args)
        saved = rng_state.save()
        with torch.no_grad():
            outputs = function(*args)
        single = isinstance(outputs, torch.Tensor)
        outputs = (outputs,) if single else tuple(outputs)
        if not isinstance(outputs[0], torch.Tensor) or any(isinstance(o, torch.Tensor) for o in outputs[1:]):
            # A second tensor out (a cross-attention context) would need its own gradient: Megatron's checkpoint.
            rng_state.restore(saved)
            return original(function, distribute_saved_activations, *args)
        leaf = outputs[0].detach().requires_grad_(True)
        run.chunks[copy_context.current_copy()].append(Chunk(function, args, saved, leaf))
        return leaf if single else (leaf, *outputs[1:])

    checkpoint.__wrapped__ = original
    return checkpoint


def _sum(a, b):
    return a if b is None else b if a is None else a + b


def _stretch(outputs, grads, starts, stretch_cuts, params, chunk_linears):
    """One stretch's backward in bands: ``outputs`` back to the leaves ``starts`` (an output that is its
    own start passes its gradient through)."""
    through = [output is start for output, start in zip(outputs, starts)]
    if all(through):
        return list(grads), [None] * len(params)
    got, grad_params = segments.backward(outputs, grads, starts, stretch_cuts, params, chunk_linears)
    return [g if same else r for same, g, r in zip(through, grads, got)], grad_params


def _recompute(block, chunks: list, chunk_linears: bool) -> tuple:
    """Every copy's chunk forward again, the copies taking turns, cuts recorded: (inputs, outputs, cuts)."""
    n = len(chunks)
    inputs = [chunk.args[0].detach().requires_grad_(True) for chunk in chunks]

    def copy(index):
        def run():
            rng_state.restore(chunks[index].rng)  # this copy's state at the chunk's forward
            with torch.enable_grad():
                outputs = chunks[index].function(inputs[index], *chunks[index].args[1:])
            return outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        return run

    held = rng_state.save()
    run = scheduler.CopyRun(n, save=rng_state.save, restore=rng_state.restore, chunk_linears=chunk_linears)
    run.cuts = [[] for _ in range(n)]
    try:
        with cuts.marking(block), collectives.INTERCEPTION.entered():
            outputs = run.run([copy(i) for i in range(n)])
    finally:
        rng_state.restore(held)  # the backward goes on from its own state, as Megatron's recompute does
    return inputs, outputs, run.cuts


def backward(block, pieces, outputs, grads, forward_cuts, chunks, params=(), chunk_linears=True):
    """The copies' backward of a block whose forward recorded ``chunks`` (one list per copy, forward
    order): stretch by stretch (module docstring). Returns (each copy's input gradient, the parameters'
    gradients summed over the copies and stretches, with ``params``)."""
    n = len(pieces)
    grad_params = [None] * len(params)

    def add(more):
        for index, grad in enumerate(more):
            grad_params[index] = _sum(grad_params[index], grad)

    current, stretch_cuts = list(outputs), forward_cuts  # the forward's cuts: the last stretch's (no grad in chunks)
    for index in reversed(range(len(chunks[0]))):
        chunk = [chunks[copy][index] for copy in range(n)]
        grads, more = _stretch(current, grads, [c.output for c in chunk], stretch_cuts, params, chunk_linears)
        add(more)
        inputs, recomputed, recomputed_cuts = _recompute(block, chunk, chunk_linears)
        grads, more = segments.backward(recomputed, grads, inputs, recomputed_cuts, params, chunk_linears)
        add(more)
        current, stretch_cuts = [c.args[0] for c in chunk], [[] for _ in range(n)]
        for c in chunk:
            c.args = c.function = None  # the chunk's inputs go with its backward, as Megatron's do
    grads, more = _stretch(current, grads, pieces, stretch_cuts, params, chunk_linears)
    add(more)
    return grads, grad_params
