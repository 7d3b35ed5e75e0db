"""Multi-copy parallel on one TransformerBlock call: split, run the copies in turns, join.

A call cut as splits.py planned runs Megatron's own block forward on each copy (its batch rows of
every per-sample input, or its part of the sequence: sequence.py, the copies meeting in the
attention: meeting.py), the copies taking turns at their collectives (scheduler.py), and joins the
outputs: one split and one join per block. The copies' forward marks their cut points (cuts.py); the
block's backward is one autograd node that runs every copy's backward in one reentrant call on the
thread autograd calls it on, their nodes interleaved at the cuts in a fixed order (segments.py).
"""

from __future__ import annotations

import contextlib

import torch

from coc_inject import rng_state
from coc_inject.multi_copy import collectives, cuts, meeting, moe, recompute, scheduler, segments, sequence
from coc_inject.multi_copy.splits import BATCH_DIMS, SEQUENCE, Split


def _pieces(tensor, dim: int, sizes: list) -> list:
    return list(tensor.split(sizes, dim=dim))


class CopiesRunner:
    """Runs one block call as copies: forward (the copies in turns) and, later, their backward."""

    def __init__(self, block, original, arguments: dict, split: Split):
        self.block, self.original, self.split = block, original, split
        self.arguments = arguments
        self.cuts = [[] for _ in range(split.copies)]  # each copy's cut points (recorded with grad on)
        self.chunks = [[] for _ in range(split.copies)]  # each copy's fully recomputed chunks (recompute.py)
        self.layout = sequence.Layout(split.copies, split.group)  # where the copies' rows are

    def _copy_arguments(self, index: int) -> dict:
        if self.split.kind == SEQUENCE:
            return sequence.copy_arguments(self.arguments, index, self.split.copies)
        arguments = dict(self.arguments)
        for name in self.split.cut:
            arguments[name] = _pieces(arguments[name], BATCH_DIMS[name], self.split.sizes)[index].contiguous()
        return arguments

    def join(self, outputs: list) -> torch.Tensor:
        """The copies' outputs (or their inputs' gradients) in Megatron's layout."""
        return self.layout.from_copies(torch.cat(outputs, dim=self.split.dim))

    def cut_up(self, tensor: torch.Tensor) -> list:
        """A tensor in Megatron's layout (the input, the output's gradient) as the copies' pieces."""
        return _pieces(self.layout.to_copies(tensor), self.split.dim, self.split.sizes)

    @contextlib.contextmanager
    def running(self):
        """Everything the copies of this block need while they compute forward, entered here alone, by
        the block's forward (auto's trials go through it too) and by a recomputed chunk's forward
        (recompute.py): the column linears' cut marks, the collectives' interception, each MoE layer's
        dispatcher per copy with its routers told the split (two copies sharing Megatron's dispatcher
        overwrite each other's split sizes between its all-to-alls), and with a sequence split the
        copies' meeting in the attention."""
        block, split = self.block, self.split
        answering = contextlib.nullcontext()
        if split.kind == SEQUENCE:  # the copies meet in the attention (meeting.py)
            answering = meeting.Meeting(split.copies, split.mask, _kernel_preference()).answering(block)
        with cuts.marking(block), answering, collectives.INTERCEPTION.entered(), moe.per_copy(block, split):
            yield

    def run_copies(self, work: list, record_cuts: list | None, chunks: list | None) -> list:
        """``work`` (one callable per copy) as copies taking turns inside :meth:`running`: their results.
        ``record_cuts`` / ``chunks``: where the copies record their cut points / checkpointed chunks (None: not)."""
        run = scheduler.CopyRun(self.split.copies, save=rng_state.save, restore=rng_state.restore,
                                inner=self.split.inner)
        run.cuts, run.chunks = record_cuts, chunks
        with self.running():
            return run.run(work)

    def forward(self, hidden: torch.Tensor, grad: bool):
        pieces = [piece.detach().contiguous().requires_grad_(grad) for piece in self.cut_up(hidden)]
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

        chunks = self.chunks if grad and self.split.kind != SEQUENCE else None  # else Megatron's recompute
        try:
            outputs = self.run_copies([copy(i) for i in range(self.split.copies)], self.cuts if grad else None, chunks)
        finally:
            if not block.pre_process:
                block.input_tensor = held_input
        return pieces, outputs

    def backward(self, pieces, outputs, grad_output, params=()):
        """The copies' backward (segments.py) and the input's gradient. Without ``params`` the
        parameters' gradients accumulate as they do without copies; with them (auto's trials) they
        are returned, summed over the copies, and nothing is accumulated."""
        grads = [piece.contiguous() for piece in self.cut_up(grad_output)]
        with collectives.INTERCEPTION.entered():
            if any(self.chunks):  # full recompute: stretch by stretch, the recomputed forward as copies
                grad_pieces, grad_params = recompute.backward(self, pieces, outputs, grads, params)
            else:
                grad_pieces, grad_params = segments.backward(outputs, grads, pieces, self.cuts, params,
                                                             self.split.inner)
        return self.join(grad_pieces), grad_params


def backward_in_turn(block, cut: bool) -> str | None:
    """Why the copies of a block call cannot overlap in their backward (``cut``: their forward marked
    a cut point), or None."""
    if cut or not torch.is_grad_enabled():
        return None
    if getattr(block.config, "recompute_granularity", None) == "full":
        return ("full recompute through Megatron's own checkpoint (distributed saved activations, or sequence "
                "copies) builds the layers' graph in the backward, where no cut is recorded")
    return "no column-parallel linear (or sequence-parallel reduce-scatter) in the block's graph"


class CopiesThroughBlock(torch.autograd.Function):
    """Block forward as copies in turns; its backward as the copies' backward interleaved at their cuts."""

    @staticmethod
    def forward(ctx, runner, hidden, *params):
        pieces, outputs = runner.forward(hidden, grad=True)
        ctx.runner, ctx.pieces, ctx.outputs, ctx.params = runner, pieces, outputs, params
        return runner.join([output.detach() for output in outputs])

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_params = ctx.runner.backward(ctx.pieces, ctx.outputs, grad_output, ctx.params)
        ctx.pieces = ctx.outputs = ctx.params = None  # the copies' graphs go with this node
        return (None, grad_input, *grad_params)


def copies_call(block, original, arguments: dict, split: Split, params_for_grad: bool = False) -> tuple:
    """The block call (``arguments``: from :func:`splits.bind`) as ``split.copies`` copies (``split`` from
    :func:`splits.plan`): ``(output, why the copies' backward runs in turn or None)``, handed back to the
    caller rather than left on the block. ``params_for_grad``: the parameters are inputs of the
    autograd node (for ``torch.autograd.grad`` over them: auto's trials)."""
    hidden = arguments["hidden_states"] if block.pre_process else block.input_tensor
    bound_original = original.__get__(block, type(block))
    runner = CopiesRunner(block, bound_original, arguments, split)
    if not torch.is_grad_enabled():
        _, outputs = runner.forward(hidden, grad=False)
        return runner.join(outputs), None
    params = [p for p in block.parameters() if p.requires_grad] if params_for_grad else []
    output = CopiesThroughBlock.apply(runner, hidden, *params)
    return output, backward_in_turn(block, any(runner.cuts) or any(runner.chunks))


def run_copies(block, original, arguments: dict, split: Split, params_for_grad: bool = False):
    """:func:`copies_call`'s output alone (auto's trials)."""
    return copies_call(block, original, arguments, split, params_for_grad)[0]


def _kernel_preference() -> str:
    """COC_ATTN_KERNEL of the job (auto without one)."""
    from coc_inject import job

    current = job.current()
    return getattr(getattr(current, "config", None), "attn_kernel", None) or "auto"
