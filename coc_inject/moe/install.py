"""install() of the MoE wing, and its post-import hook (registered by bootstrap) on
``megatron.core.transformer.moe.moe_layer``; patches through the job's installation.

Megatron's ``MoELayer.forward`` runs unchanged (routing, permutation, shared expert, recompute,
aux losses); for a layer that runs as pieces, the dispatcher's two all-to-alls and the experts'
loop move into one call in the experts' place:

* ``token_dispatch`` / ``dispatch_postprocess`` pass the permuted local rows on (after Megatron's
  own host synchronisation points), the all-to-all deferred;
* ``SequentialMLP.forward`` runs the pieces (function.py): dispatch, experts, combine;
* ``combine_preprocess`` / ``token_combine`` pass the combined rows on to Megatron's unpermute.

``MoELayer.forward`` decides per call (guards.py) and tells its dispatcher and experts.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from coc_inject import job, log
from coc_inject.moe import auto, guards, layout
from coc_inject.moe.function import PieceRun, PipelinedExperts
from coc_inject.routes import MoERoute

MIN_PIECES = 8  # COC_MOE_OVERLAP=1 cuts each local expert's rows into chunks up to this many pieces (with P pieces
# a layer takes about max(C, M) + min(C, M) / P: 8 reach ~90% of the limit max(C, M) at C = M)
MOE = job.MOE  # this wing's tuner
AUTO_CHOSE_MEGATRON = "auto: Megatron's dispatcher was faster for this shape"
_DECIDING = -1  # a call of COC_MOE_OVERLAP=auto whose shape is decided in the experts' place


def chunks_per_expert(local_experts: int) -> int:
    return max(1, math.ceil(MIN_PIECES / local_experts))


@dataclass
class _Call:
    """A layer call running as pieces: what the dispatcher's deferred stages hand the experts."""

    chunks: int | str  # per local expert; auto.MEGATRON once auto decided Megatron's dispatcher
    dispatcher: object
    key: object = None  # auto's MoEKey
    tokens_per_expert: object = None


@dataclass(frozen=True)
class _Megatron:
    """Megatron's own stages, for auto's baseline and for a call auto gives back to Megatron."""

    token_dispatch: object
    dispatch_postprocess: object
    experts_forward: object
    combine_preprocess: object
    token_combine: object

    def middle(self, experts, call: _Call, tokens, probs):
        """Dispatch, experts and combine as Megatron runs them."""
        dispatcher = call.dispatcher
        dispatcher.tokens_per_expert = call.tokens_per_expert  # as the deferred stages found it
        tokens, probs = self.token_dispatch(dispatcher, tokens, probs)
        tokens, tokens_per_expert, probs = self.dispatch_postprocess(dispatcher, tokens, probs)
        output, _ = self.experts_forward(experts, tokens, tokens_per_expert, probs)
        return self.token_combine(dispatcher, self.combine_preprocess(dispatcher, output))


def install(config, moe_layer_module, chunks: int | None = None) -> None:
    """Patch for ``config.moe_overlap``, counting no calls (tests, bench; the import hook counts):
    into the job's installation for ``config``. Undone by ``job.uninstall()``. ``chunks``: a fixed
    count per local expert instead of COC_MOE_OVERLAP=1's (the bench's variants)."""
    _install(job.installation(config), moe_layer_module, chunks)


def banner(config) -> str:
    pieces = "pieces or Megatron's per layer shape (auto)" if config.moe_overlap == "auto" else "pieces"
    return f"MoE overlap installed on MoELayer: alltoall dispatch and combine in {pieces} (details: coc-inject status)"


def _install(installation, moe_layer_module, chunks: int | None = None) -> None:
    from megatron.core.transformer.moe import experts, token_dispatcher

    patches = installation.patches
    dispatcher, mlp, layer = token_dispatcher.MoEAlltoAllTokenDispatcher, experts.SequentialMLP, moe_layer_module.MoELayer
    stages = {"token_dispatch": _deferred_dispatch, "dispatch_postprocess": _deferred_postprocess,
              "combine_preprocess": _passed_on, "token_combine": _passed_on}
    megatron = _Megatron(**{name: patches.original(dispatcher, name) for name in stages},
                         experts_forward=patches.original(mlp, "forward"))
    for name, deferred in stages.items():
        patches.patch(dispatcher, name, _when_pieces(patches.original(dispatcher, name), deferred))
    pieces_forward = functools.partial(_experts_forward, installation, megatron)
    patches.patch(mlp, "forward", _when_pieces(megatron.experts_forward, pieces_forward))
    patches.patch(layer, "forward", _layer_forward(installation, patches.original(layer, "forward"), chunks))


on_moe_layer_imported = job.wing_hook(lambda config: config.moe_armed, _install, banner)


def _when_pieces(original, deferred):
    @functools.wraps(original)
    def stage(self, *args, **kwargs):
        call = getattr(self, "_coc_moe_call", None)
        return original(self, *args, **kwargs) if call is None else deferred(self, call, *args, **kwargs)

    return stage


def _deferred_dispatch(dispatcher, call, tokens, probs):
    dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall",
                                                                          dispatcher.tokens_per_expert)
    return tokens, probs


def _deferred_postprocess(dispatcher, call, tokens, probs):
    dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize("before_permutation_2",
                                                                          dispatcher.tokens_per_expert)
    call.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize("before_finish", dispatcher.tokens_per_expert)
    dispatcher.tokens_per_expert = None
    return tokens, call.tokens_per_expert, probs


def _passed_on(dispatcher, call, hidden_states, *args, **kwargs):
    return hidden_states


def _counts(values) -> list:
    return torch.as_tensor(values).flatten().tolist()


def piece_layout(dispatcher, chunks: int) -> list:
    """The pieces of the dispatcher's current call (its routing map and Megatron's split counts)."""
    ep, tp, local = dispatcher.ep_size, dispatcher.tp_size, dispatcher.num_local_experts
    local_counts = _counts(dispatcher.routing_map.sum(dim=0))
    if local > 1:  # [tp * ep, local experts]
        received = _counts(dispatcher.num_global_tokens_per_local_expert)
    elif tp == 1:  # one local expert: what each EP rank sends it
        received = _counts(dispatcher.output_splits)
    else:  # one local expert with expert TP: Megatron keeps only its own TP rank's counts
        received = _gathered_counts(dispatcher, local_counts)
    per_rank = [received[r * local:(r + 1) * local] for r in range(tp * ep)]
    global_counts = [per_rank[t * ep:(t + 1) * ep] for t in range(tp)]
    return layout.pieces(local_counts, global_counts, local, chunks, dispatcher.tp_rank)


def _gathered_counts(dispatcher, local_counts: list) -> list:
    """Rows each (TP, EP) rank sends this rank's one local expert, [tp * ep], as Megatron's preprocess
    gathers them over the TP x EP group (the same small all-gather, again)."""
    import torch.distributed as dist

    group = dispatcher.tp_ep_group
    mine = torch.tensor(local_counts)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    # Megatron's order of the TP x EP group is EP-major: [ep, tp, experts]
    by_rank = torch.stack(gathered).reshape(dispatcher.ep_size, dispatcher.tp_size, -1).transpose(0, 1)
    return by_rank[:, :, dispatcher.local_expert_indices[0]].flatten().tolist()


def _pieces(experts, call: _Call, tokens, probs, chunks: int, accumulate: bool = True):
    """The combined rows, in the dispatcher's permuted order, of the pieces at ``chunks`` per expert."""
    apply_on_input = experts.config.moe_apply_probs_on_input

    def expert(index, rows, row_probs):
        if apply_on_input:  # as SequentialMLP: probs scale the input, then count as 1
            rows = (row_probs.unsqueeze(-1) * rows).to(rows.dtype)
            row_probs = torch.ones_like(row_probs)
        output, _ = experts.local_experts[index](rows, row_probs)
        return output

    parameters = any(p.requires_grad for p in experts.parameters())
    needs_grad = torch.is_grad_enabled() and (tokens.requires_grad or probs.requires_grad or parameters)
    dispatcher = call.dispatcher
    tp_group = dispatcher.tp_group if dispatcher.tp_size > 1 else None
    run = PieceRun(piece_layout(dispatcher, chunks), expert, dispatcher.ep_group, tp_group,
                   dispatcher.probs.dtype, needs_grad, accumulate)
    return PipelinedExperts.apply(tokens, probs, run)


def _experts_forward(installation, megatron: _Megatron, experts, call: _Call, tokens, tokens_per_expert, probs):
    """SequentialMLP's forward in a call whose dispatch was deferred: (combined rows, None)."""
    if call.chunks == _DECIDING:
        with auto.without_fused_accumulation(experts):
            call.chunks = auto.choose(
                installation.tuner(MOE), call.key, call.dispatcher.ep_group, tokens, probs,
                lambda t, p: megatron.middle(experts, call, t, p),
                lambda t, p, chunks: _pieces(experts, call, t, p, chunks, accumulate=False))
    if call.chunks == auto.MEGATRON:
        return megatron.middle(experts, call, tokens, probs), None
    return _pieces(experts, call, tokens, probs, call.chunks), None


def _layer_forward(installation, original, chunks: int | None):
    deciding = installation.config.moe_overlap == "auto"

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        reason = _layer_reason(self) or guards.call_reason(self)
        call = None
        if reason is None:
            dispatcher = self.token_dispatcher
            call = _Call(chunks or chunks_per_expert(dispatcher.num_local_experts), dispatcher)
            if deciding:
                call.key = auto.key_of(self, hidden_states)
                decided = installation.tuner(MOE).decisions.get(call.key)
                call.chunks = _DECIDING if decided is None else decided.choice
                if call.chunks == auto.MEGATRON:
                    call, reason = None, AUTO_CHOSE_MEGATRON
        self.token_dispatcher._coc_moe_call = self.experts._coc_moe_call = call
        output = original(self, hidden_states, *args, **kwargs)
        _count(installation, self, call, reason)
        return output

    return forward


def _layer_reason(layer):
    cached = layer.__dict__.get("_coc_moe_layer_reason", _unset)
    if cached is _unset:
        cached = layer.__dict__["_coc_moe_layer_reason"] = guards.layer_reason(layer)
    return cached


_unset = object()


def _count(installation, layer, call, reason) -> None:
    if call is not None and call.chunks == auto.MEGATRON:  # auto decided at this call
        call, reason = None, AUTO_CHOSE_MEGATRON
    if call is None:
        route = MoERoute(0, 0, reason)
    else:
        route = MoERoute(call.dispatcher.num_local_experts * call.chunks, call.chunks)
    layer._coc_moe = route  # this layer's last route (tests, and a user poking at the model)
    if reason is not None and reason != AUTO_CHOSE_MEGATRON:
        log.once(("moe", reason), logging.WARNING, f"MoE overlap: an MoE layer runs Megatron's path: {reason}")
    if installation.coverage is not None:
        installation.coverage.count(layer, route, None, _no_shape)


def _no_shape(layer, input_) -> list:
    return []
