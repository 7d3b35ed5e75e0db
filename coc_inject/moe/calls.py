"""One MoE layer call: whether it runs as pieces, its state while it runs, and its pieces.

``MoELayer.forward``'s wrapper decides per call (guards.py, auto's decisions) and makes the call's
state (:class:`MoECall`) the current one for exactly the length of Megatron's forward: a context
variable, reset in a ``finally``. The stages stages.py wraps read it there; nothing is written to
Megatron's layer, dispatcher or experts for a call. A stage of another layer, or one run outside a
layer's forward, finds no call of its own and runs as Megatron wrote it: Megatron's MoE recompute
(``recompute_modules=["moe"]``) re-runs the layer's routing, dispatch, experts and combine from the
backward, outside the forward, so the recompute runs Megatron's dispatcher on the same rows and
experts (the forward's output came from the pieces, equal within rounding).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from coc_inject import copy_context, job, log, verdicts
from coc_inject.allowlist import check
from coc_inject.moe import auto, counts, grouped, guards
from coc_inject.moe.function import PieceRun, PipelinedExperts
from coc_inject.pipeline import agreement
from coc_inject.routes import COPIES_CHOSE_DISPATCHER, MoERoute

# COC_MOE_OVERLAP=1 cuts each local expert's rows into chunks up to this many pieces: with P pieces a
# layer takes about max(C, M) + min(C, M) / P, so 8 pieces reach 8/9 of the limit max(C, M) at C = M.
MIN_PIECES = 8
MOE = job.MOE  # this wing's tuner
AUTO_CHOSE_MEGATRON = "auto: Megatron's dispatcher was faster for this shape"
DECIDING = -1  # a call of COC_MOE_OVERLAP=auto whose shape is decided in the experts' place


def chunks_per_expert(local_experts: int) -> int:
    return max(1, math.ceil(MIN_PIECES / local_experts))


def default_chunks(layer) -> int:
    """COC_MOE_OVERLAP=1's chunks: MIN_PIECES pieces, each one expert's chunk (SequentialMLP) or a chunk
    of every local expert's rows (grouped experts: one grouped GEMM per piece)."""
    return MIN_PIECES if grouped.is_grouped(layer.experts) else chunks_per_expert(layer.token_dispatcher.num_local_experts)


def piece_count(layer, chunks: int) -> int:
    return chunks if grouped.is_grouped(layer.experts) else layer.token_dispatcher.num_local_experts * chunks


@dataclass
class MoECall:
    """A layer call running as pieces, from its forward's start to its end."""

    installation: object
    layer: object
    chunks: int | str  # per local expert; DECIDING; auto.MEGATRON once auto chose Megatron's dispatcher
    megatron_middle: Callable  # (call, tokens, probs) -> combined rows: dispatch, experts, combine as Megatron
    key: object = None  # auto's MoEKey
    tokens_per_expert: object = None  # Megatron's, on the host (its dispatch_postprocess returns it)
    sent: list = None  # rows this rank sends each global expert
    received: list = None  # rows each (TP, EP) rank sends each local expert, [tp * ep * local]

    @property
    def dispatcher(self):
        return self.layer.token_dispatcher

    @property
    def experts(self):
        return self.layer.experts

    def look_up(self, hidden_states) -> None:
        """COC_MOE_OVERLAP=auto: this shape's choice if decided, else DECIDING (in the experts' place)."""
        self.key = auto.key_of(self.layer, hidden_states)
        decided = self.installation.tuner(MOE).decisions.get(self.key)
        self.chunks = DECIDING if decided is None else decided.choice

    def take_counts(self, host_tokens_per_expert) -> None:
        """The counts counts.riding sent along with Megatron's, now on the host."""
        self.tokens_per_expert, self.sent, self.received = counts.split(self.dispatcher, host_tokens_per_expert)

    def run_experts(self, tokens, probs):
        """Dispatch, experts and combine of the deferred rows: the combined rows in the dispatcher's
        permuted order (auto decides here at a shape's first call)."""
        if self.chunks == DECIDING:
            # Decided over expert TP x EP, not EP alone: with expert TP the pieces' collectives also run
            # over the expert-TP group, so every rank of it must make the same choice.
            group = getattr(self.dispatcher, "tp_ep_group", None) or self.dispatcher.ep_group
            self.chunks = auto.choose(
                self.installation.tuner(MOE), self.key, group, tokens, probs,
                lambda t, p: self.megatron_middle(self, t, p),
                lambda t, p, chunks: self.pieces(t, p, chunks), self.experts)
        if self.chunks == auto.MEGATRON:
            return self.megatron_middle(self, tokens, probs)
        return self.pieces(tokens, probs, self.chunks)

    def pieces(self, tokens, probs, chunks: int):
        """The combined rows of the pieces at ``chunks`` per expert."""
        experts, dispatcher = self.experts, self.dispatcher
        apply_on_input = experts.config.moe_apply_probs_on_input
        in_groups = grouped.is_grouped(experts)

        def expert(piece, rows, row_probs):
            if apply_on_input:  # as SequentialMLP: probs scale the input, then count as 1
                rows = (row_probs.unsqueeze(-1) * rows).to(rows.dtype)
                row_probs = torch.ones_like(row_probs)
            output, _ = experts.local_experts[piece.expert](rows, row_probs)
            return output

        if in_groups:  # one call of the experts' own forward per piece (it applies the probs as its release does)
            expert = grouped.expert(experts, grouped.megatron_forward(self.installation.patches, experts))

        parameters = [p for p in experts.parameters() if p.requires_grad]
        needs_grad = torch.is_grad_enabled() and (tokens.requires_grad or probs.requires_grad or bool(parameters))
        tp_group = dispatcher.tp_group if dispatcher.tp_size > 1 else None
        layout = counts.piece_layout(dispatcher, chunks, self.sent, self.received, in_groups)
        run = PieceRun(layout, expert, dispatcher.ep_group, tp_group, dispatcher.probs.dtype, needs_grad,
                       None if in_groups else _reaches(layout, experts, parameters))
        # The experts' parameters are the Function's inputs: their gradients, summed over the pieces, reach
        # autograd once per layer call, as from Megatron's experts (one AccumulateGrad, one DDP hook each).
        return PipelinedExperts.apply(tokens, probs, run, *(parameters if needs_grad else ()))


def _reaches(layout: list, experts, parameters: list) -> list:
    """Per piece of SequentialMLP, the indices in ``parameters`` of its local expert's (and of any parameter
    outside the local experts): a sum is rounded after the last piece that can reach it (gradient_sums.py)."""
    owners: dict = {}
    for j, local in enumerate(experts.local_experts):
        for param in local.parameters():
            owners.setdefault(id(param), set()).add(j)
    return [tuple(i for i, param in enumerate(parameters) if piece.expert in owners.get(id(param), (piece.expert,)))
            for piece in layout]


_current: contextvars.ContextVar = contextvars.ContextVar("coc_inject_moe_call", default=None)


def current(owner) -> MoECall | None:
    """The running call if ``owner`` (a layer, its dispatcher or its experts) is one of its objects."""
    call = _current.get()
    if call is None or not (owner is call.layer or owner is call.dispatcher or owner is call.experts):
        return None
    return call


def layer_forward(installation, original, chunks: int | None, megatron_middle: Callable, taken=None):
    """``MoELayer.forward``: decide the call, run Megatron's forward with the call current, count it.
    ``taken``: the experts classes whose forward stages.py made run the pieces (None: the layer's stages)."""
    deciding = installation.config.moe_overlap == "auto"
    # The settings agreed over the expert groups the pieces' (and auto's) collectives run over, at the first call.
    check = agreement.FirstCall(installation.config,
                                f"the MoE pieces (COC_MOE_OVERLAP={installation.config.moe_overlap}) at their first layer call")

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if check.pending:
            dispatcher = getattr(self, "token_dispatcher", None)
            check([getattr(dispatcher, "tp_ep_group", None) or getattr(dispatcher, "ep_group", None)],
                  {"MoE pieces can run here": megatron_middle is not None})
        verdict = self.__dict__.get(VERDICT)
        if verdict is None or not verdict.holds(installation, self.__dict__.get("config"), _groups(self)):
            verdict = _decide(installation, self, taken)
        route = verdict.value
        if route is not None:  # every call of this layer: Megatron's dispatcher, said at the decision
            self.__dict__["_coc_moe"] = route  # as _count keeps it (a plain value: no Module.__setattr__)
            if installation.coverage is not None:
                installation.coverage.count(self, route, None, _no_shape)
            return original(self, hidden_states, *args, **kwargs)
        reason = guards.call_reason(self, hidden_states)
        if reason is None and deciding and not copy_context.experts_in_pieces():
            reason = COPIES_CHOSE_DISPATCHER  # the block's trials found its copies faster without pieces
        call = None
        if reason is None:
            call = MoECall(installation, self, chunks or default_chunks(self), megatron_middle)
            if deciding:
                call.look_up(hidden_states)
                if call.chunks == auto.MEGATRON:
                    call, reason = None, AUTO_CHOSE_MEGATRON
        scope = _current.set(call)
        try:
            output = original(self, hidden_states, *args, **kwargs)
        finally:
            _current.reset(scope)
        _count(installation, self, call, reason)
        return output

    return forward


VERDICT = "_coc_moe_verdict"  # on the layer: verdicts.Verdict of _decide


def _groups(layer):
    """What the layer's verdict is keyed by beside its config: its dispatcher's EP size (the group the pieces
    would cross; read through multi-copy's per-copy dispatcher alike)."""
    return getattr(layer.__dict__.get("token_dispatcher"), "ep_size", None)


def _decide(installation, layer, taken=None) -> verdicts.Verdict:
    """guards.layer_reason (its construction and config, not its input) as the route every call of the layer
    takes (None: each call decides), kept on the layer keyed by what it read; and where the pieces run in the experts' forward, whether this job took over that of the layer's
    experts class."""
    reason = guards.layer_reason(layer)
    if reason is None and taken is not None and not isinstance(layer.experts, tuple(taken)):
        reason = (f"{type(layer.experts).__name__} experts: this megatron-core's stages run the pieces in "
                  f"the experts' forward, taken over here for {' / '.join(c.__name__ for c in taken)} only")
    if reason is not None:
        log.once(("moe", reason), logging.WARNING, f"MoE overlap: an MoE layer runs Megatron's path: {reason}")
    config = layer.__dict__.get("config")
    read = check.reads(type(config), check.MOE) if config is not None else verdicts.nothing
    route = None if reason is None else MoERoute(0, 0, reason)  # counted at every call of the layer
    return verdicts.remember(installation, layer, VERDICT, config, read, _groups(layer), route)


def _count(installation, layer, call, reason) -> None:
    if call is not None and call.chunks == auto.MEGATRON:  # auto decided at this call
        call, reason = None, AUTO_CHOSE_MEGATRON
    if call is None:
        route = MoERoute(0, 0, reason)
    else:
        route = MoERoute(piece_count(layer, call.chunks), call.chunks)
    layer.__dict__["_coc_moe"] = route  # its last route (tests, selftest, a user poking at the model)
    if reason is not None and reason not in (AUTO_CHOSE_MEGATRON, COPIES_CHOSE_DISPATCHER):
        log.once(("moe", reason), logging.WARNING, f"MoE overlap: an MoE layer runs Megatron's path: {reason}")
    if installation.coverage is not None:
        installation.coverage.count(layer, route, None, _no_shape)


def _no_shape(layer, input_) -> list:
    return []
