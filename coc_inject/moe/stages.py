"""Where a call that runs as pieces leaves Megatron's MoE forward: which of Megatron's methods are
wrapped, each running as Megatron wrote it unless its layer's call (calls.current) runs as pieces.

Every release: the dispatcher's ``preprocess`` sends the pieces' counts along with Megatron's
(counts.riding). Then, where ``MoELayer`` has ``dispatch``, ``routed_experts_compute`` and
``combine`` (megatron-core >= 0.16): ``dispatch`` passes the permuted local rows on (after
Megatron's host synchronisation point), ``routed_experts_compute`` runs the pieces (dispatch,
experts, combine) and ``combine`` passes the combined rows on to Megatron's unpermute. Older
releases (0.13 to 0.15) have no such layer methods: the dispatcher's ``token_dispatch`` /
``dispatch_postprocess`` pass the rows on, the experts' forward (``SequentialMLP``'s, and the legacy
``GroupedMLP``'s where Megatron's own class is in place) runs the pieces,
``combine_preprocess`` / ``token_combine`` pass the combined rows on. A release with neither
(0.12: the dispatcher's ``token_permutation`` / ``token_unpermutation`` do it all) has those two
methods taken over by permutation_stages.py, for 0.12's own dispatcher only; any other layer without
stages runs Megatron's dispatcher, with guards.missing_stages()'s reason.
"""

from __future__ import annotations

import functools

from coc_inject.moe import counts
from coc_inject.moe.calls import current
from coc_inject.moe.guards import DISPATCHER_STAGES, LAYER_STAGES



def has_layer_stages(layer_class) -> bool:
    return all(name in vars(layer_class) for name in LAYER_STAGES)


def has_dispatcher_stages(dispatcher_class, experts_classes) -> bool:
    return (all(name in vars(dispatcher_class) for name in DISPATCHER_STAGES)
            and all("forward" in vars(cls) for cls in experts_classes))


def install_preprocess(patches, dispatcher_class) -> None:
    original = patches.original(dispatcher_class, "preprocess")

    @functools.wraps(original)
    def preprocess(dispatcher, routing_map, *args, **kwargs):
        tokens_per_expert = original(dispatcher, routing_map, *args, **kwargs)
        if current(dispatcher) is None:
            return tokens_per_expert
        return counts.riding(dispatcher, routing_map, tokens_per_expert)

    patches.patch(dispatcher_class, "preprocess", preprocess)


def _synchronize(dispatcher, point: str) -> None:
    """Megatron's device-to-host copy / synchronisation for ``point``, where its own stage makes it."""
    dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize(point, dispatcher.tokens_per_expert)


def _counts_to_host(call) -> None:
    """What Megatron's dispatch_postprocess does with the counts: its last two points, then the
    counts on the host to the call (the dispatcher's tokens_per_expert cleared, as Megatron leaves it)."""
    dispatcher = call.dispatcher
    _synchronize(dispatcher, "before_permutation_2")
    host = dispatcher._maybe_dtoh_and_synchronize("before_finish", dispatcher.tokens_per_expert)
    dispatcher.tokens_per_expert = None
    call.take_counts(host)


def unless_pieces(original, deferred):
    """``original`` unless its object's call runs as pieces: then ``deferred(call, *args)``."""
    @functools.wraps(original)
    def stage(self, *args, **kwargs):
        call = current(self)
        return original(self, *args, **kwargs) if call is None else deferred(call, *args, **kwargs)

    return stage


# megatron-core >= 0.16: MoELayer.dispatch / routed_experts_compute / combine


def install_layer_stages(patches, layer_class):
    """Wrap the layer's three stages; returns Megatron's middle (dispatch, experts, combine)."""
    originals = {name: patches.original(layer_class, name) for name in LAYER_STAGES}

    def dispatch(call, tokens, probs):
        _synchronize(call.dispatcher, "before_ep_alltoall")
        return tokens, probs

    def routed_experts_compute(call, tokens, probs):
        _counts_to_host(call)
        return call.run_experts(tokens, probs), None

    def combine(call, output):
        return output

    for name, deferred in zip(LAYER_STAGES, (dispatch, routed_experts_compute, combine)):
        patches.patch(layer_class, name, unless_pieces(originals[name], deferred))

    def megatron_middle(call, tokens, probs):
        layer = call.layer
        call.dispatcher.tokens_per_expert = call.tokens_per_expert  # as the deferred stages found it
        tokens, probs = originals["dispatch"](layer, tokens, probs)
        output, _ = originals["routed_experts_compute"](layer, tokens, probs)
        return originals["combine"](layer, output)

    return megatron_middle


# megatron-core 0.13 to 0.15: the dispatcher's stages and the experts' forward (SequentialMLP, GroupedMLP)


def pieces_forward(call, tokens, tokens_per_expert, probs):
    """The experts' forward's place: the pieces (dispatch, experts, combine) of the permuted local rows."""
    return call.run_experts(tokens, probs), None


def install_experts_forwards(patches, experts_classes) -> dict:
    """Each experts class's forward runs the pieces for a call that runs as pieces; returns Megatron's
    forwards by class (0.12 to 0.15, whose stages hand the experts the rows)."""
    forwards = {cls: patches.original(cls, "forward") for cls in experts_classes}
    for cls, forward in forwards.items():
        patches.patch(cls, "forward", unless_pieces(forward, pieces_forward))
    return forwards


def megatron_experts_forward(forwards: dict, experts):
    """Megatron's forward of ``experts``'s class among :func:`install_experts_forwards`' (its nearest base's)."""
    return next(forwards[cls] for cls in type(experts).__mro__ if cls in forwards)


def install_dispatcher_stages(patches, dispatcher_class, experts_classes):
    """Wrap the dispatcher's four stages and each experts class's forward; returns Megatron's middle."""
    originals = {name: patches.original(dispatcher_class, name) for name in DISPATCHER_STAGES}

    def token_dispatch(call, tokens, probs):
        _synchronize(call.dispatcher, "before_ep_alltoall")
        return tokens, probs

    def dispatch_postprocess(call, tokens, probs):
        _counts_to_host(call)
        return tokens, call.tokens_per_expert, probs

    def passed_on(call, hidden_states, *args, **kwargs):
        return hidden_states

    for name, deferred in zip(DISPATCHER_STAGES, (token_dispatch, dispatch_postprocess, passed_on, passed_on)):
        patches.patch(dispatcher_class, name, unless_pieces(originals[name], deferred))

    experts_forwards = install_experts_forwards(patches, experts_classes)

    def megatron_middle(call, tokens, probs):
        dispatcher = call.dispatcher
        dispatcher.tokens_per_expert = call.tokens_per_expert  # as the deferred stages found it
        tokens, probs = originals["token_dispatch"](dispatcher, tokens, probs)
        tokens, tokens_per_expert, probs = originals["dispatch_postprocess"](dispatcher, tokens, probs)
        forward = megatron_experts_forward(experts_forwards, call.experts)
        output, _ = forward(call.experts, tokens, tokens_per_expert, probs)
        return originals["token_combine"](dispatcher, originals["combine_preprocess"](dispatcher, output))

    return megatron_middle
