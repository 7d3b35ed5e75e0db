"""The groups over which multi-copy agrees its settings at its first block call (pipeline/agreement.py).

Copies change the size and count of every collective the block issues: tensor- and context-parallel
(each copy's linears and attention), the expert groups of an MoE block (each copy's all-to-alls), and
with an ``auto`` anywhere the group its trials agree over (tensor x context parallel, or tensor x data x
context parallel for an MoE block, multi_copy/auto.py). Each is checked in this fixed order, every group
on its own store keys: a rank whose linears, attention or MoE pieces check over the same group meets
the copies' check there, so a rank with the copies off but another wing on is named, not timed out.
"""

from __future__ import annotations


def groups(block, tuned: bool) -> list:
    """The process groups ``block``'s copies change, in the order they are agreed (None: not there)."""
    from coc_inject.multi_copy import auto, moe as copies_moe

    found = _tensor_and_context(block)
    layers = copies_moe.moe_layers(block)
    if layers:  # the same group objects as the MoE pieces' check (moe/calls.py)
        dispatcher = getattr(layers[0], "token_dispatcher", None)
        found.append(getattr(dispatcher, "tp_ep_group", None) or getattr(dispatcher, "ep_group", None))
    if tuned:
        found.append(copies_moe.trial_group(block) if layers else auto.group_of(block))
    return found


def _tensor_and_context(block) -> list:
    """The block's tensor- and context-parallel groups: its own (0.13+'s ``pg_collection``), else Megatron's
    parallel state where it is initialized."""
    collection = getattr(block, "pg_collection", None)
    if collection is not None:
        return [getattr(collection, "tp", None), getattr(collection, "cp", None)]
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return []
    return [parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()]
