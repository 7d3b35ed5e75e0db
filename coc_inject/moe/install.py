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
from coc_inject.moe import guards, layout
from coc_inject.moe.function import PieceRun, PipelinedExperts

MIN_PIECES = 4  # COC_MOE_OVERLAP=1 cuts each local expert's rows into chunks up to this many pieces


def chunks_per_expert(local_experts: int) -> int:
    return max(1, math.ceil(MIN_PIECES / local_experts))


@dataclass
class _Call:
    """A layer call running as pieces: what the dispatcher's deferred stages hand the experts."""

    chunks: int
    dispatcher: object
    tokens_per_expert: object = None


def install(config, moe_layer_module) -> None:
    """Patch for ``config.moe_overlap``, counting no calls (tests, bench; the import hook counts):
    into the job's installation for ``config``. Undone by ``job.uninstall()``."""
    _install(job.installation(config), moe_layer_module)


def on_moe_layer_imported(module) -> None:
    config = job.config()
    if not config.moe_armed or job.megatron_patchable(config) is None:
        return
    installation = job.installation(config)
    installation.armed_coverage()
    _install(installation, module)
    level = logging.INFO if log.global_rank() == 0 else logging.DEBUG
    log.logger.log(level, banner(config))


def banner(config) -> str:
    pieces = "auto (pieces or not per layer shape)" if config.moe_overlap == "auto" else "pieces per local expert"
    return f"MoE overlap installed on MoELayer: alltoall dispatch/combine in {pieces} (details: coc-inject status, COC_REPORT)"


def _install(installation, moe_layer_module) -> None:
    from megatron.core.transformer.moe import experts, token_dispatcher

    patches = installation.patches
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    for name, deferred in (("token_dispatch", _deferred_dispatch), ("dispatch_postprocess", _deferred_postprocess),
                           ("combine_preprocess", _passed_on), ("token_combine", _passed_on)):
        patches.patch(dispatcher, name, _when_pieces(patches.original(dispatcher, name), deferred))
    mlp = experts.SequentialMLP
    patches.patch(mlp, "forward", _when_pieces(patches.original(mlp, "forward"), _pieces_forward))
    layer = moe_layer_module.MoELayer
    patches.patch(layer, "forward", _layer_forward(installation, patches.original(layer, "forward")))


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
    ep, local = dispatcher.ep_size, dispatcher.num_local_experts
    local_counts = _counts(dispatcher.routing_map.sum(dim=0))
    if local > 1:
        received = _counts(dispatcher.num_global_tokens_per_local_expert)
    else:
        received = _counts(dispatcher.output_splits)
    global_counts = [received[s * local:(s + 1) * local] for s in range(ep)]
    return layout.pieces(local_counts, global_counts, ep, local, chunks)


def _pieces_forward(experts, call, tokens, tokens_per_expert, probs):
    """SequentialMLP's forward as pieces: (combined rows in the dispatcher's permuted order, None)."""
    dispatcher = call.dispatcher
    apply_on_input = experts.config.moe_apply_probs_on_input

    def expert(index, rows, row_probs):
        if apply_on_input:  # as SequentialMLP: probs scale the input, then count as 1
            rows = (row_probs.unsqueeze(-1) * rows).to(rows.dtype)
            row_probs = torch.ones_like(row_probs)
        output, _ = experts.local_experts[index](rows, row_probs)
        return output

    parameters = any(p.requires_grad for p in experts.parameters())
    needs_grad = torch.is_grad_enabled() and (tokens.requires_grad or probs.requires_grad or parameters)
    run = PieceRun(piece_layout(dispatcher, call.chunks), expert, dispatcher.ep_group, needs_grad)
    return PipelinedExperts.apply(tokens, probs, run), None


def _layer_forward(installation, original):
    setting = installation.config.moe_overlap

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        reason = _layer_reason(self) or guards.call_reason(self)
        call = None
        if reason is None:
            call = _Call(chunks_per_expert(self.token_dispatcher.num_local_experts), self.token_dispatcher)
        self.token_dispatcher._coc_moe_call = self.experts._coc_moe_call = call
        _count(installation, self, call, reason)
        return original(self, *args, **kwargs)

    return forward


def _layer_reason(layer):
    cached = layer.__dict__.get("_coc_moe_layer_reason", _unset)
    if cached is _unset:
        cached = layer.__dict__["_coc_moe_layer_reason"] = guards.layer_reason(layer)
    return cached


_unset = object()


def _count(installation, layer, call, reason) -> None:
    layer._coc_moe = ("pieces", call.chunks) if call is not None else ("megatron", reason)
    if reason is not None:
        log.once(("moe", reason), logging.WARNING, f"MoE overlap: an MoE layer runs Megatron's path: {reason}")
