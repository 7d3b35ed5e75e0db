"""Full recompute with copies: the recomputed forward runs as copies too, its cuts recorded, and each
recomputed stretch's backward runs in bands (segments.py) like a block without recompute.

Megatron's full recompute (``--recompute-granularity full``, methods ``uniform`` and ``block``)
runs chunks of layers through ``tensor_parallel.checkpoint``: the chunk's forward under no grad, and
in the backward, per chunk, the forward again and a backward of its own. Inside a copy that
backward would run one copy's chunk at a time, the copies' collectives in turn. So inside a copies'
forward that records cuts, :func:`checkpoint` takes a chunk's call instead (Megatron's block-chunk
function alone, :data:`BLOCK_CHUNKS`: a sub-layer's checkpoint -- selective recompute of ``mlp``,
``moe``, ``shared_experts``, ``core_attn`` -- is not a stretch of the residual stream, and runs as
Megatron's inside the copies' backward, one copy's node at a time in its band): the chunk's forward runs under
no grad as Megatron's does (each copy's RNG state kept for its recompute), and its output becomes a
leaf of the copy's graph (:class:`Chunk` records how to recompute it). The block's backward
(:func:`backward`) then goes from the block's output back, one stretch at a time, every copy at once:

* the stretch from the block's output to the last chunk's output (the final layer norm, with the
  ``block`` method the layers not recomputed, their cuts from the forward): in bands;
* per chunk, last first: the chunk's forward again for every copy, as copies taking turns on
  threads inside the same scope as the block's forward (block.CopiesRunner.running: its MoE layers'
  dispatchers per copy, the routers' losses formed per copy; the recomputed forward's collectives
  overlap too), its cuts recorded; then that stretch's backward in bands, into the chunk's input;
* the stretch from the first chunk's input back to the block's input, where there is one.

The copies' threads only compute forward ops; autograd's own calls stay on the thread that runs the
block's node. Every collective is issued at a program point of a copy: the same order on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from coc_inject import copy_context, rng_state
from coc_inject.multi_copy import segments

CHECKPOINT = ("megatron.core.tensor_parallel", "checkpoint")  # what Megatron's blocks call per chunk
# The function TransformerBlock's full recompute checkpoints per chunk of layers, (module, qualname):
# an allow-list -- any other checkpointed function runs Megatron's checkpoint.
BLOCK_CHUNKS = frozenset({
    # megatron-core 0.13.1, 0.16.1: TransformerBlock._checkpointed_forward's closure
    ("megatron.core.transformer.transformer_block",
     "TransformerBlock._checkpointed_forward.<locals>.custom.<locals>.custom_forward"),
    # megatron-core 0.19.2: the same closure, moved to megatron/core/recompute.py
    ("megatron.core.recompute", "checkpointed_forward.<locals>.custom.<locals>.custom_forward"),
    # MindSpeed 26.0+ (install.READ_BLOCK_FORWARDS): its _checkpointed_forward's closure, 0.12.1's with a
    # per-layer FP8 context (mindspeed/te/pytorch/module/checkpoint.py, transformer_block_checkpointed_forward)
    ("mindspeed.te.pytorch.module.checkpoint",
     "transformer_block_checkpointed_forward.<locals>.custom.<locals>.custom_forward"),
})


@dataclass
class Chunk:
    """One copy's checkpointed chunk: ``function(*args)`` recomputes it from the RNG state ``rng``;
    ``output`` is the leaf the copy's graph goes on from (the chunk's first output)."""

    function: object
    args: tuple
    rng: tuple
    output: torch.Tensor


# Selective recompute the copies run exactly: Megatron's checkpoint of a sub-layer, its node recomputed
# inside the copies' backward, in its copy's band (an allow-list; tests/multi_copy: exact, every rank's
# collectives in one order). What else a block's layers recompute runs Megatron's block, with why:
SELECTIVE = frozenset({"core_attn", "moe", "shared_experts"})
REFUSED = {
    # the output-discarding checkpoints keep each call's checkpoint object on the module from the
    # checkpoint to the discard of its output, a collective later: the copies' turns would swap them
    **dict.fromkeys(("layernorm", "moe_act", "mla_up_proj", "gdn_norm_out"),
                    "Megatron keeps each call's output-discarding checkpoint on the module until a later step "
                    "discards the output: the copies' turns would swap them"),
    # unverified: on the CPU test bed (TP 2 SP, gloo) the copies' backward re-entered the MLP checkpoint's
    # own node, and Megatron's own run of it without copies does not finish there either
    "mlp": "the dense MLP's checkpoint inside the copies' backward is not verified exact",
}


def reason(block) -> str | None:
    """Why ``block``'s copies cannot run under its selective recompute, or None."""
    config = block.config
    if getattr(config, "recompute_granularity", None) != "selective":
        return None
    modules = set(getattr(config, "recompute_modules", None) or ())
    if "mlp" in modules and not any(getattr(layer, "recompute_mlp", False) for layer in block.layers):
        modules.discard("mlp")  # MoE layers: Megatron checkpoints no dense MLP
    other = sorted(modules - SELECTIVE)
    if not other:
        return None
    return f"selective recompute of {other[0]} ({REFUSED.get(other[0], 'not on the copies allow-list')})"


def is_block_chunk(function) -> bool:
    """Is ``function`` a chunk of a TransformerBlock's layers, checkpointed by its full recompute?"""
    return (getattr(function, "__module__", None), getattr(function, "__qualname__", None)) in BLOCK_CHUNKS


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
        if (run is None or not is_block_chunk(function) or distribute_saved_activations
                or not isinstance(hidden, torch.Tensor) or not hidden.requires_grad or not torch.is_grad_enabled()
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


def _stretch(outputs, grads, starts, stretch_cuts, params, inner):
    """One stretch's backward in bands: ``outputs`` back to the leaves ``starts`` (an output that is its
    own start passes its gradient through)."""
    through = [output is start for output, start in zip(outputs, starts)]
    if all(through):
        return list(grads), [None] * len(params)
    got, grad_params = segments.backward(outputs, grads, starts, stretch_cuts, params, inner)
    return [g if same else r for same, g, r in zip(through, grads, got)], grad_params


def _recompute(runner, chunks: list) -> tuple:
    """Every copy's chunk forward again, the copies taking turns inside the block's copies' scope
    (``runner``: block.CopiesRunner), cuts recorded: (inputs, outputs, cuts)."""
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
    recorded = [[] for _ in range(n)]
    try:
        outputs = runner.run_copies([copy(i) for i in range(n)], recorded, None)
    finally:
        rng_state.restore(held)  # the backward goes on from its own state, as Megatron's recompute does
    return inputs, outputs, recorded


def backward(runner, pieces, outputs, grads, params=()):
    """The copies' backward of a block call (``runner``: its block.CopiesRunner) whose forward recorded
    chunks (``runner.chunks``, one list per copy, forward order): stretch by stretch (module docstring).
    Returns (each copy's input gradient, the parameters' gradients summed over the copies and
    stretches, with ``params``)."""
    n, chunks, forward_cuts, inner = len(pieces), runner.chunks, runner.cuts, runner.split.inner
    grad_params = [None] * len(params)

    def add(more):
        for index, grad in enumerate(more):
            grad_params[index] = _sum(grad_params[index], grad)

    current, stretch_cuts = list(outputs), forward_cuts  # the forward's cuts: the last stretch's (no grad in chunks)
    for index in reversed(range(len(chunks[0]))):
        chunk = [chunks[copy][index] for copy in range(n)]
        grads, more = _stretch(current, grads, [c.output for c in chunk], stretch_cuts, params, inner)
        add(more)
        inputs, recomputed, recomputed_cuts = _recompute(runner, chunk)
        grads, more = segments.backward(recomputed, grads, inputs, recomputed_cuts, params, inner)
        add(more)
        current, stretch_cuts = [c.args[0] for c in chunk], [[] for _ in range(n)]
        for c in chunk:
            c.args = c.function = None  # the chunk's inputs go with its backward, as Megatron's do
    grads, more = _stretch(current, grads, pieces, stretch_cuts, params, inner)
    add(more)
    return grads, grad_params
