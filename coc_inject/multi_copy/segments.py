"""The copies' backward from one thread, interleaved at their collectives in a fixed order.

Each copy's graph is cut at the marks its forward recorded (cuts.py): segment ``k`` holds the nodes
created between cut ``k`` and cut ``k + 1`` (autograd numbers a thread's nodes in creation order).
Autograd's engine runs, of the nodes that are ready, the one with the highest sequence number, so
the copies' nodes are renumbered into bands, highest first::

    copy 0's segment K, copy 1's segment K, copy 0's cut K, copy 0's segment K-1, copy 1's cut K, ...

and one backward call over every copy's output runs them on the thread autograd calls the block's
node on, with no other thread. The node right after a cut (the column linear, the reduce-scatter
mapping) leaves the collective of the cut's kind in flight; the cut's own node waits for it, after
the other copy's segment has been issued. Every other wait stays where Megatron put it. So every
rank issues comm0(K), comm1(K), comm0(K-1), ... in program order, and on a device each wait is
issued after the other copy's kernels: that is the overlap. The gradient crossing a cut is read
only after that wait (by the cut's node, its only consumer); a residual branch's joins it after.

A sequence-parallel column linear's backward (Megatron's) also all-gathers its saved input again for
the weight gradient and waits for it inside the same node, with only its own input-gradient matmul
in between: in the bands nothing else would be queued before that wait. So its gather is issued
ahead, by the cut opening the linear's band (before that cut's wait), into a buffer of its own
(collectives.Gathered); the linear's own all-gather of the same input is served from it. The
gather then overlaps the copy's segment up to the linear, as the other copy's compute overlapped it
when the copies' backward ran on threads. CoC's chunked column linear is not gathered ahead: its band
also holds CoC's row linear, whose chunked all-gathers (no cut of their own) would queue behind a gather
issued at the band start on the same group, in order on gloo and NCCL alike (tried: the GPT step with 2
copies and 4 chunks, 0.945x; benchmarks/RESULTS.md). Its own backward issues the re-gather ahead of its
dgrad chunks.

The parameters' gradients accumulate as they do without copies: one AccumulateGrad per parameter,
run once with the copies' gradients summed, with its hooks (Megatron's DDP hears of it once). A
copy with no cut runs its whole backward in its band: the copies in turn, in the same order still.

The code inside a node learns which copy it runs as (:meth:`Segmented.running_copy`, e.g. for the
copy's own global memory buffer) from the node autograd runs now: renumbering records each new
sequence number's copy, so no hook is added to the copies' nodes, in tests or in production.
"""

from __future__ import annotations

import bisect

import torch

from coc_inject import copy_context
from coc_inject.multi_copy import collectives
from coc_inject.multi_copy.cuts import REDUCE
from coc_inject.multi_copy.scheduler import Copies
from coc_inject.routes import AS_SET, Inner

_TOP = 1 << 62  # new sequence numbers count down from here (the engine compares them only within a call)


class Segmented(Copies):
    """The copies' backward run (what the code inside sees as copy_context.current())."""

    def __init__(self, n: int, inner: Inner = AS_SET):
        super().__init__(n, inner)
        self.deferring = None  # (kind, copy) inside a node right after a cut, else None
        self.pending = [[] for _ in range(n)]  # each copy's collectives in flight
        self.copy_of_node: dict = {}  # a renumbered node's sequence number -> its copy (renumber())
        self.band_gathers: dict = {}  # id(a cut's node) -> [(tensor, group)] gathered when its band starts
        self.gathered = [[] for _ in range(n)]  # each copy's gathers issued ahead, not yet served
        self._issuing = False

    def running_copy(self) -> int | None:
        """The copy of the node autograd runs now; None in a node of no copy (a recompute's, built
        inside the backward, or a parameter's AccumulateGrad)."""
        node = torch._C._current_autograd_node()
        return None if node is None else self.copy_of_node.get(node._sequence_nr())

    def defers(self, kind) -> bool:
        return self.deferring is not None and kind == self.deferring[0]

    def hold(self, work) -> None:
        self.pending[self.deferring[1]].append(work)

    def complete(self, copy: int) -> None:
        """Wait for ``copy``'s collectives in flight (a cut's node, before the gradient goes on)."""
        pending, self.pending[copy] = self.pending[copy], []
        for work in pending:
            work.complete()

    def start_band(self, cut_node) -> None:
        """A cut's node starts its copy's band: the gathers of that band's column linear, issued now."""
        entries = self.band_gathers.pop(id(cut_node), ())
        self._issuing = True
        try:
            for tensor, group in entries:
                self.gathered[cut_node.copy].append(collectives.Gathered(tensor, group))
        finally:
            self._issuing = False

    def serve(self, output, tensor, group):
        """The running copy's gather issued ahead for this all-gather (collectives.py), or None."""
        copy = None if self._issuing else self.running_copy()
        if copy is None:
            return None
        mine = self.gathered[copy]
        for index, gathered in enumerate(mine):
            if gathered.matches(output, tensor, group):
                return mine.pop(index).serve(output)
        return None

    def ending(self, node, kind: str, copy: int) -> list:
        """Hooks making ``node`` leave its collectives of ``kind`` in flight (their handles)."""
        def before(grad_outputs):
            self.deferring = (kind, copy)

        def after(grad_inputs, grad_outputs):
            self.deferring = None

        return [node.register_prehook(before), node.register_hook(after)]


def gathers_input(node) -> bool:
    """Is ``node`` Megatron's column linear whose backward all-gathers its saved input (sequence
    parallel, the weight gradient computed there: no deferral buffer)?"""
    return (type(node).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
            and getattr(node, "sequence_parallel", False) is True and getattr(node, "grad_output_buffer", 0) is None
            and _tp_group(node) is not None and getattr(node, "gtp_remat_size", 1) in (None, 0, 1))


def _tp_group(node):
    """The group the linear's backward all-gathers over: its ``tp_group`` (0.13+), parallel_state's on 0.12."""
    from coc_inject.linears.guards import NO_GROUP, tp_group

    group = tp_group(node)
    return None if group is NO_GROUP else group


def bands(output: torch.Tensor, cuts: list, claimed: set | None = None) -> tuple:
    """The nodes of one copy's graph by segment, and its ends: ``(segments, cut_nodes, ends, gathers)``
    where ``segments[k]`` lists segment k's nodes (cut nodes apart) and ``cut_nodes[k]`` the node of the
    cut opening segment k (None for segment 0), ``ends`` (node after a cut, kind) where that cut
    has exactly one such node, ``gathers`` (the cut node starting a band, tensor, group) for each
    column linear that re-gathers its input in that band. ``cuts``: (sequence number, node, kind) in
    forward order (cuts.CutPoint: with the input a column linear may gather). ``claimed``:
    the nodes (ids) of the copies walked before, left out and added to (a sequence copy's attention
    reaches into the earlier copies' graphs, meeting.py: those nodes keep their own copy's band)."""
    claimed = set() if claimed is None else claimed
    bounds = [seq for seq, _, _ in cuts]
    cut_ids = {id(node) for _, node, _ in cuts}
    segments = [[] for _ in range(len(cuts) + 1)]
    cut_nodes = [None] + [node for _, node, _ in cuts]
    consumers: dict = {}
    start = output.grad_fn
    seen, stack = {id(start)}, [start]
    while stack:
        node = stack.pop()
        if id(node) not in cut_ids:
            segments[bisect.bisect_right(bounds, node._sequence_nr())].append(node)
        for next_node, _ in node.next_functions:
            if next_node is None or hasattr(next_node, "variable") or id(next_node) in claimed:
                continue  # AccumulateGrad: runs when ready; another copy's node: in that copy's band
            if id(next_node) in cut_ids:
                consumers.setdefault(id(next_node), []).append(node)
            if id(next_node) not in seen:
                seen.add(id(next_node))
                stack.append(next_node)
    claimed.update(seen)
    ends, gathers = [], []
    for index, point in enumerate(cuts):
        _, node, kind = point
        found = consumers.get(id(node), [])
        if len(found) == 1:  # two would sum the deferred gradient before the wait: leave that cut's waits be
            ends.append((found[0], kind))
            tensor = getattr(point, "input", None)
            # The linear is the first node of segment index + 1, whose band the next cut's node starts.
            if kind == REDUCE and tensor is not None and index + 1 < len(cuts) and gathers_input(found[0]):
                gathers.append((cuts[index + 1][1], tensor, _tp_group(found[0])))
    return segments, cut_nodes, ends, gathers


def renumber(per_copy: list) -> dict:
    """Sequence numbers in band order (module docstring); ``per_copy``: :func:`bands` of each copy.
    Returns each new sequence number's copy."""
    seq = _TOP
    copy_of_node = {}
    count = max(len(bands_[0]) for bands_ in per_copy)
    for k in reversed(range(count)):
        for copy, (segments, cut_nodes, *_) in enumerate(per_copy):
            if k >= len(segments):
                continue
            opening_next = cut_nodes[k + 1] if k + 1 < len(cut_nodes) else None
            band = ([opening_next] if opening_next is not None else []) + sorted(
                segments[k], key=lambda node: node._sequence_nr(), reverse=True)
            for node in band:
                node._set_sequence_nr(seq)
                copy_of_node[seq] = copy
                seq -= 1
    return copy_of_node


def backward(outputs: list, grad_outputs: list, pieces: list, cuts: list, params=(), inner: Inner = AS_SET):
    """Every copy's backward, interleaved (module docstring). Returns each copy's input gradient and,
    with ``params``, their gradients (summed over the copies, nothing accumulated: auto's trials)."""
    n = len(outputs)
    run = Segmented(n, inner)
    claimed: set = set()
    per_copy = [bands(output, copy_cuts, claimed) for output, copy_cuts in zip(outputs, cuts)]
    run.copy_of_node = renumber(per_copy)
    handles = []
    for copy, (_, _, ends, gathers) in enumerate(per_copy):
        for node, kind in ends:
            handles += run.ending(node, kind, copy)
        for cut_node, tensor, group in gathers:
            run.band_gathers.setdefault(id(cut_node), []).append((tensor, group))
    outer, outer_index = copy_context.current(), copy_context.current_copy()
    copy_context.enter(run, None)
    try:
        if params:
            grads = torch.autograd.grad(outputs, [*pieces, *params], grad_outputs, allow_unused=True)
            grad_pieces, grad_params = list(grads[:n]), list(grads[n:])
        else:
            torch.autograd.backward(outputs, grad_outputs)
            grad_pieces, grad_params = [piece.grad for piece in pieces], []
    finally:
        for pending in run.pending + run.gathered:  # nothing may stay in flight (after a failure: into freed memory)
            for work in pending:
                work.complete()
        for handle in handles:
            handle.remove()
        if outer is None:
            copy_context.leave()
        else:
            copy_context.enter(outer, outer_index)
    grad_pieces = [g if g is not None else torch.zeros_like(p) for g, p in zip(grad_pieces, pieces)]
    return grad_pieces, grad_params

