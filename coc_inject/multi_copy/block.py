"""Multi-copy parallel on one TransformerBlock call: split, run the copies in turns, join.

A block call splits its micro-batch along the batch dimension into ``n`` copies (hidden states
``[s, b, h]`` on dim 1, with or without sequence parallelism; the mask's and every per-sample
input's batch rows with them; rotary embeddings shared), runs Megatron's own block forward on
each copy, the copies taking turns at their collectives (scheduler.py), and joins the outputs:
one split and one join per block. The copies' forward marks their cut points (cuts.py); the
block's backward is one autograd node that runs every copy's backward in one reentrant call on the
thread autograd calls it on, their nodes interleaved at the cuts in a fixed order (segments.py).

A call that copies cannot run exactly runs Megatron's block with a reason (:func:`plan`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from coc_inject import rng_state
from coc_inject.multi_copy import collectives, cuts, scheduler, segments

# Per-sample arguments of TransformerBlock.forward and their batch dimension; others are
# shared by every copy when they hold no batch (rotary embeddings) or refused (plan()).
BATCH_DIMS = {"hidden_states": 1, "context": 1, "attention_mask": 0, "context_mask": 0, "padding_mask": 0,
              "attention_bias": 0}
SHARED = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")
# Arguments copies cannot take: inference state and packed sequences (Megatron's path, with the reason).
REFUSED = {"inference_context": "inference", "inference_params": "inference", "sequence_len_offset": "inference",
           "packed_seq_params": "packed sequences (THD)", "extract_layer_indices": "extract_layer_indices",
           "dynamic_inference_decode_only": "inference"}

# What runs Megatron's block instead, in short (coc-inject status; each reason in full: block_reason, plan).
WITHOUT_COPIES = ("a micro-batch not divisible by the copies", "dropout > 0", "MoE layers", "packed sequences",
                  "inference", "fp8 / fp4", "CPU offloading", "CUDA graphs",
                  "a torch whose autograd the copies' backward cannot rely on (checked at install)")


@dataclass(frozen=True)
class Split:
    """How one call is cut: the copies' sizes along the batch and which arguments are cut."""

    copies: int
    batch: int
    cut: tuple  # names of the arguments cut along their batch dimension
    chunk_linears: bool = True  # False: COC_PARALLEL_NUM=auto's linears run Megatron's path in the copies

    @property
    def sizes(self) -> list:
        return [self.batch // self.copies] * self.copies


def block_reason(block, copies: int) -> str | None:
    """Why ``block`` cannot run as copies at all (whatever the call), or None."""
    config = block.config
    if block.training and (config.hidden_dropout > 0 or config.attention_dropout > 0):
        return (f"dropout > 0 (hidden {config.hidden_dropout}, attention {config.attention_dropout}): the copies would "
                "draw their masks in another order")
    for flag in ("fp8", "fp4", "cpu_offloading"):
        if getattr(config, flag, None):
            return f"{flag} is on"
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        return "CUDA graphs are on"
    for layer in block.layers:
        if "MoE" in type(getattr(layer, "mlp", None)).__name__:
            return "MoE layers (routing statistics and the aux loss are per batch)"
    return None


def plan(block, copies: int, arguments: dict) -> Split | str:
    """The split of one call (``arguments``: forward's arguments by name), or why not."""
    for name, why in REFUSED.items():
        value = arguments.get(name)
        if value is not None and not (name == "extract_layer_indices" and not value):
            return f"{why} ({name} given)"
    hidden = arguments.get("hidden_states")
    if not block.pre_process:
        hidden = block.input_tensor
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return "the hidden states are not one [s, b, h] tensor"
    batch = hidden.shape[1]
    if batch % copies:
        return f"micro-batch {batch} is not divisible by {copies} copies"
    cut = []
    for name, value in arguments.items():
        if name in ("self", "hidden_states") or value is None:
            continue
        dim = BATCH_DIMS.get(name)
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return f"{name} requires grad (its gradient would not reach it through the copies)"
            rows = value.shape[dim] if dim is not None and value.dim() > dim else None
            if rows == batch:
                cut.append(name)
            elif rows not in (None, 1):
                return f"{name} has {rows} rows for micro-batch {batch}"
            elif dim is None and name not in SHARED:
                return f"an argument coc-inject does not know how to split ({name})"
        elif name not in BATCH_DIMS and name not in SHARED and name not in REFUSED and not _plain(value):
            return f"an argument coc-inject does not know how to split ({name})"
    return Split(copies, batch, tuple(cut))


def _plain(value) -> bool:
    return isinstance(value, (bool, int, float, str, type(None)))


def _pieces(tensor, dim: int, sizes: list) -> list:
    return list(tensor.split(sizes, dim=dim))


class CopiesRunner:
    """Runs one block call as copies: forward (the copies in turns) and, later, their backward."""

    def __init__(self, block, original, arguments: dict, split: Split):
        self.block, self.original, self.split = block, original, split
        self.arguments = arguments
        self.cuts = [[] for _ in range(split.copies)]  # each copy's cut points (recorded with grad on)

    def _copy_arguments(self, index: int) -> dict:
        arguments = dict(self.arguments)
        for name in self.split.cut:
            arguments[name] = _pieces(arguments[name], BATCH_DIMS[name], self.split.sizes)[index].contiguous()
        return arguments

    def forward(self, hidden: torch.Tensor, grad: bool):
        pieces = [piece.detach().contiguous().requires_grad_(grad) for piece in _pieces(hidden, 1, self.split.sizes)]
        block, original = self.block, self.original
        held_input = getattr(block, "input_tensor", None)

        def copy(index):
            def run():
                arguments = self._copy_arguments(index)
                if block.pre_process:
                    arguments["hidden_states"] = pieces[index]
                else:  # Megatron reads a pipeline stage's input before the first collective: one copy's turn
                    block.input_tensor = pieces[index]
                with torch.set_grad_enabled(grad):
                    output = original(**arguments)
                if not isinstance(output, torch.Tensor):
                    raise TypeError(f"TransformerBlock.forward returned {type(output).__name__}, not a tensor: "
                                    "multi-copy cannot join it")
                return output
            return run

        run = scheduler.CopyRun(self.split.copies, save=rng_state.save, restore=rng_state.restore,
                                chunk_linears=self.split.chunk_linears)
        run.cuts = self.cuts if grad else None
        try:
            with cuts.marking(block), collectives.INTERCEPTION.entered():
                outputs = run.run([copy(i) for i in range(self.split.copies)])
        finally:
            if not block.pre_process:
                block.input_tensor = held_input
        return pieces, outputs

    def backward(self, pieces, outputs, grad_output, params=()):
        """The copies' backward (segments.py) and the input's gradient. Without ``params`` the
        parameters' gradients accumulate as they do without copies; with them (auto's trials) they
        are returned, summed over the copies, and nothing is accumulated."""
        grads = [piece.contiguous() for piece in _pieces(grad_output, 1, self.split.sizes)]
        with collectives.INTERCEPTION.entered():
            grad_pieces, grad_params = segments.backward(outputs, grads, pieces, self.cuts, params,
                                                         self.split.chunk_linears)
        return torch.cat(grad_pieces, dim=1), grad_params


def backward_in_turn(block, cut: bool) -> str | None:
    """Why the copies of a block call cannot overlap in their backward (``cut``: their forward marked
    a cut point), or None."""
    if cut or not torch.is_grad_enabled():
        return None
    if getattr(block.config, "recompute_granularity", None) == "full":
        return "full recompute builds the layers' graph in the backward, where no cut is recorded"
    return "no column-parallel linear (or sequence-parallel reduce-scatter) in the block's graph"


class CopiesThroughBlock(torch.autograd.Function):
    """Block forward as copies in turns; its backward as the copies' backward interleaved at their cuts."""

    @staticmethod
    def forward(ctx, runner, hidden, *params):
        pieces, outputs = runner.forward(hidden, grad=True)
        ctx.runner, ctx.pieces, ctx.outputs, ctx.params = runner, pieces, outputs, params
        return torch.cat([output.detach() for output in outputs], dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_params = ctx.runner.backward(ctx.pieces, ctx.outputs, grad_output, ctx.params)
        ctx.pieces = ctx.outputs = ctx.params = None  # the copies' graphs go with this node
        return (None, grad_input, *grad_params)


def bind(original, block, args, kwargs) -> dict:
    """forward's arguments by name (``self`` left out), defaults included."""
    bound = inspect.signature(original).bind(block, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", None)
    if extra:
        arguments.update(extra)
    return arguments


def copies_call(block, original, arguments: dict, split: Split, params_for_grad: bool = False) -> tuple:
    """The block call (``arguments``: from :func:`bind`) as ``split.copies`` copies (``split`` from
    :func:`plan`): ``(output, why the copies' backward runs in turn or None)``, handed back to the
    caller rather than left on the block. ``params_for_grad``: the parameters are inputs of the
    autograd node (for ``torch.autograd.grad`` over them: auto's trials)."""
    hidden = arguments["hidden_states"] if block.pre_process else block.input_tensor
    bound_original = original.__get__(block, type(block))
    runner = CopiesRunner(block, bound_original, arguments, split)
    if not torch.is_grad_enabled():
        _, outputs = runner.forward(hidden, grad=False)
        return torch.cat(outputs, dim=1), None
    params = [p for p in block.parameters() if p.requires_grad] if params_for_grad else []
    output = CopiesThroughBlock.apply(runner, hidden, *params)
    return output, backward_in_turn(block, any(runner.cuts))


def run_copies(block, original, arguments: dict, split: Split, params_for_grad: bool = False):
    """:func:`copies_call`'s output alone (auto's trials)."""
    return copies_call(block, original, arguments, split, params_for_grad)[0]
