"""megatron-core 0.12: the alltoall dispatcher's ``token_permutation`` / ``token_unpermutation``
around the pieces.

0.12 has none of the stages stages.py wraps: ``token_permutation`` runs the preprocess, permutation 1,
the EP all-to-all, the expert-TP all-gather and permutation 2 in one call, ``token_unpermutation`` the
reverse. For a call that runs as pieces, both are replaced by Megatron's local lines of the two
methods as 0.12 wrote them: the call's state on the dispatcher, ``preprocess`` (the pieces' counts
riding along, counts.riding), its four ``_maybe_dtoh_and_synchronize`` points in their order,
permutation 1 and unpermutation 1 by Megatron's own ``permute`` / ``unpermute`` (as the dispatcher's
module names them). The all-to-alls, the expert-TP all-gather / reduce-scatter and permutation 2 are
the pieces' (``MoECall.run_experts`` in the experts' forward's place, as on 0.13 to 0.15). A call
that does not run as pieces runs Megatron's two methods untouched.

The lines restated here are 0.12's, so they run only where the dispatcher class is 0.12's own in a
megatron-core 0.12 (guards.permutation_reason; any other release's layer runs Megatron's dispatcher
with that reason). What they leave out is refused by the allow-list before a call gets here:
drop-and-pad (``moe_pad_expert_input_to_capacity``), permute fusion (``moe_permute_fusion``),
Megatron's shared-expert overlap (``moe_shared_expert_overlap``, without which 0.12 never sets the
dispatcher's ``shared_experts``: its hooks run on the rows between the all-to-alls). Megatron's
middle for ``auto``'s baseline (EP all-to-all to the return all-to-all) is 0.12's lines too, through
the module's own ``all_to_all`` / gather / ``sort_chunks_by_idxs`` / reduce-scatter.
"""

from __future__ import annotations

import functools
import sys

import torch

from coc_inject.moe.guards import PERMUTATION_STAGES, permutation_reason
from coc_inject.moe.stages import install_experts_forwards, megatron_experts_forward, unless_pieces

# 0.12's _maybe_dtoh_and_synchronize points of token_permutation, in its order (the copy at the first).
POINTS = ("before_permutation_1", "before_ep_alltoall", "before_permutation_2", "before_finish")


def has_permutation_stages(dispatcher_class) -> bool:
    """0.12's own alltoall dispatcher in a megatron-core 0.12 (the only code the lines below restate)."""
    return permutation_reason(dispatcher_class) is None


def install(patches, dispatcher_class, experts_classes):
    """Wrap the dispatcher's two methods and each experts class's forward; returns Megatron's middle."""
    originals = {name: patches.original(dispatcher_class, name) for name in PERMUTATION_STAGES}
    patches.patch(dispatcher_class, "token_permutation", unless_pieces(originals["token_permutation"], _permutation))
    patches.patch(dispatcher_class, "token_unpermutation",
                  unless_pieces(originals["token_unpermutation"], _unpermutation))
    return functools.partial(_megatron_middle, install_experts_forwards(patches, experts_classes))


def _megatron(dispatcher):
    """The dispatcher's module: the functions its own methods call, by the names they call them."""
    return sys.modules[dispatcher.__class__.__module__]  # __class__: multi-copy's stand-in too


def _permutation(call, hidden_states, probs, routing_map):
    """0.12's token_permutation without its all-to-all, all-gather and permutation 2: the permuted
    local rows, Megatron's counts per local expert (host) and the permuted probs."""
    self, megatron = call.dispatcher, _megatron(call.dispatcher)
    self.hidden_shape = hidden_states.shape
    self.probs = probs
    self.routing_map = routing_map
    assert probs.dim() == 2, "Expected 2D tensor for probs"
    assert routing_map.dim() == 2, "Expected 2D tensor for token2expert mask"
    assert routing_map.dtype == torch.bool, "Expected bool tensor for mask"
    hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
    tokens_per_expert = self.preprocess(self.routing_map)  # the pieces' counts ride along (stages.py)
    tokens_per_expert = self._maybe_dtoh_and_synchronize(POINTS[0], tokens_per_expert)
    self.hidden_shape_before_permute = hidden_states.shape
    tokens, permuted_probs, self.reversed_local_input_permutation_mapping = megatron.permute(
        hidden_states, routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
        fused=self.config.moe_permute_fusion, drop_and_pad=self.drop_and_pad)
    for point in POINTS[1:]:  # Megatron's points, where its all-to-all, gather and permutation 2 would be
        tokens_per_expert = self._maybe_dtoh_and_synchronize(point, tokens_per_expert)
    call.take_counts(tokens_per_expert)
    return tokens, call.tokens_per_expert, permuted_probs


def _unpermutation(call, hidden_states, bias=None):
    """0.12's token_unpermutation without its permutation 2, reduce-scatter and all-to-all:
    unpermutation 1 of the combined rows, in the input's shape."""
    self, megatron = call.dispatcher, _megatron(call.dispatcher)
    assert bias is None, "Bias is not supported in MoEAlltoAllTokenDispatcher"
    output = megatron.unpermute(
        hidden_states, self.reversed_local_input_permutation_mapping, restore_shape=self.hidden_shape_before_permute,
        routing_map=self.routing_map, fused=self.config.moe_permute_fusion, drop_and_pad=self.drop_and_pad)
    return output.view(self.hidden_shape), None


def _megatron_middle(experts_forwards, call, tokens, probs):
    """What 0.12's two methods do between permutation 1 and unpermutation 1 (auto's baseline, or the
    call whose trials chose Megatron): all-to-all, all-gather, permutation 2, the experts, and back."""
    self, megatron = call.dispatcher, _megatron(call.dispatcher)
    tokens = megatron.all_to_all(self.ep_group, tokens, self.output_splits, self.input_splits)
    probs = megatron.all_to_all(self.ep_group, probs, self.output_splits, self.input_splits)
    sizes = None if self.output_splits_tp is None else self.output_splits_tp.tolist()  # on the host already
    if self.tp_size > 1:
        tokens = megatron.gather_from_sequence_parallel_region(tokens, group=self.tp_group, output_split_sizes=sizes)
        probs = megatron.gather_from_sequence_parallel_region(probs, group=self.tp_group, output_split_sizes=sizes)
    fused = self.config.moe_permute_fusion
    if self.num_local_experts > 1:
        tokens, probs = megatron.sort_chunks_by_idxs(
            tokens, self.num_global_tokens_per_local_expert.ravel(), self.sort_input_by_local_experts, probs=probs,
            fused=fused)
    forward = megatron_experts_forward(experts_forwards, call.experts)
    output, _ = forward(call.experts, tokens, call.tokens_per_expert, probs)
    if self.num_local_experts > 1:
        output, _ = megatron.sort_chunks_by_idxs(
            output, self.num_global_tokens_per_local_expert.T.ravel(), self.restore_output_by_local_experts,
            fused=fused)
    if self.tp_size > 1:
        output = megatron.reduce_scatter_to_sequence_parallel_region(
            output.to(self.probs.dtype), group=self.tp_group, input_split_sizes=sizes).to(output.dtype)
    return megatron.all_to_all(self.ep_group, output, self.input_splits, self.output_splits)
