"""Does an MoE layer's call run as pieces? Each guard names what runs on Megatron's path, and why.

The pieces replace the dispatcher's all-to-alls and the local experts' loop of Megatron's
``alltoall`` dispatcher with ``SequentialMLP`` experts (a piece: one local expert's chunk) or grouped
experts, the legacy ``GroupedMLP`` or ``TEGroupedMLP`` (a piece: a chunk of every local expert's rows, one
call of their forward); whatever else Megatron does around them (routing, permutation, the shared expert,
recompute, the aux losses) runs as Megatron wrote it.
The layer's config is checked first against the MoE pieces' allow-list (coc_inject/allowlist/moe.py).
"""

from __future__ import annotations

import torch

from coc_inject import megatron_version, mindspeed
from coc_inject.allowlist import check

# What status names as running on Megatron's path (the reasons below, briefly).
WITHOUT_PIECES = ("the allgather and flex dispatchers", "TEGroupedMLP's fused op-fuser path", "EP 1", "FP8 / FP4",
                  "permute fusion", "padding to capacity", "Megatron's own EP or shared-expert overlap",
                  "CUDA graphs", "inference mode", "torch.autocast (enable_autocast)",
                  "a setting the allow-list refuses or does not classify (docs/settings-allowlist.md)")

# The layer's own objects the pieces run (an allow-list: any other runs Megatron's dispatcher, with the reason).
DISPATCHERS = ("MoEAlltoAllTokenDispatcher",)  # Megatron's class also behind multi-copy's per-copy dispatcher
# GroupedMLP, TEGroupedMLP: moe/grouped.py (one call of its forward per piece; TEGroupedMLP by that interface,
# tested against stand-ins of Transformer Engine's grouped linears only).
EXPERTS = ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
_NOT_PIECES = {  # why a known dispatcher class is not among DISPATCHERS
    "MoEAllGatherTokenDispatcher": "the allgather dispatcher: it moves every token to every rank (nothing to cut "
                                   "per expert)",
    "MoEFlexTokenDispatcher": "the flex dispatcher (DeepEP / HybridEP kernels)",
}


# What the pieces read of a layer's objects (beyond what Megatron's own stages set during a call): one
# lacking any (a megatron-core release outside the tested range) runs Megatron's dispatcher, naming it.
LAYER_READS = ("config", "token_dispatcher", "experts")
DISPATCHER_READS = ("config", "ep_size", "tp_size", "tp_rank", "num_local_experts", "local_expert_indices",
                    "ep_group", "tp_group", "tp_ep_group", "preprocess", "_maybe_dtoh_and_synchronize")
EXPERTS_READS = ("config", "local_experts")
GROUPED_EXPERTS_READS = ("config", "num_local_experts", "forward")  # GroupedMLP, TEGroupedMLP (moe/grouped.py)


# The dispatcher's methods MindSpeed's --moe-permute-fusion replaces or wraps (coc_inject/mindspeed.py).
MINDSPEED_DISPATCH = ("preprocess", "_maybe_dtoh_and_synchronize")


def layer_reason(layer) -> str | None:
    """Why this MoE layer cannot run as pieces (None: it can). Decided once per layer: these are
    the layer's construction, not its input."""
    for part, name in ((layer, "MoELayer"), (getattr(layer, "token_dispatcher", None), "token dispatcher"),
                       (getattr(layer, "experts", None), "experts")):
        feature = mindspeed.class_feature(type(part), mindspeed.MOE)
        if feature is not None:  # MindSpeed's class in Megatron's place: its dispatch is MindSpeed's
            return mindspeed.aside(mindspeed.MOE, f"{type(part).__name__} ({name})", feature).split(": ", 1)[1]
    dispatcher_class = type(getattr(layer, "token_dispatcher", None))
    for name in MINDSPEED_DISPATCH:  # methods MindSpeed sets on Megatron's class, after coc-inject's install too
        feature = mindspeed.attribute_feature(dispatcher_class, name, mindspeed.MOE)
        if feature is not None:
            return mindspeed.aside(mindspeed.MOE, f"{dispatcher_class.__name__}.{name}", feature).split(": ", 1)[1]
    missing = _missing(layer, LAYER_READS)
    if missing is not None:
        return missing
    why = check.refusal(layer.config, check.MOE)  # the config's settings: coc_inject/allowlist/moe.py
    if why is not None:
        return why
    dispatcher = getattr(layer, "token_dispatcher", None)
    kind = dispatcher.__class__.__name__
    if kind not in DISPATCHERS:
        return _NOT_PIECES.get(kind, f"an unknown token dispatcher ({kind})")
    experts = type(getattr(layer, "experts", None)).__name__
    if experts not in EXPERTS:
        return f"{experts} experts: pieces need {' or '.join(EXPERTS)}"
    if getattr(layer.experts, "_with_fused_impl", False):
        return ("TEGroupedMLP's fused path (use_transformer_engine_op_fuser: Transformer Engine's op fuser over "
                "device-side counts and output buffers): not run as pieces")
    missing = (_missing(dispatcher, DISPATCHER_READS)
               or _missing(layer.experts, EXPERTS_READS if experts == "SequentialMLP" else GROUPED_EXPERTS_READS)
               or missing_stages(layer))
    if missing is not None:
        return missing
    if dispatcher.ep_size == 1:
        return "expert parallelism 1: no all-to-all to overlap"
    return None


def _missing(owner, names) -> str | None:
    for name in names:
        try:
            getattr(owner, name)
        except AttributeError:
            return (f"{type(owner).__name__} has no attribute {name!r} (a megatron-core release coc-inject "
                    "does not know)")
    return None


# Megatron's enable_autocast (or a caller's torch.autocast): the pieces' own sums and collectives are not
# checked against Megatron's dispatcher under it (tests/moe/test_moe.py), so they step aside.
AUTOCAST = "torch.autocast is on (Megatron's enable_autocast): the pieces are not verified under it"


def call_reason(layer, hidden_states=None) -> str | None:
    """Why this call cannot run as pieces although the layer can (None: it can)."""
    if hidden_states is not None and torch.is_autocast_enabled(hidden_states.device.type):
        return AUTOCAST
    try:
        from megatron.core.inference.utils import InferenceMode  # 0.19: a separate inference dispatcher
    except ImportError:
        return None
    if hasattr(layer, "_inference_token_dispatcher") and InferenceMode.is_active():
        return "inference mode (Megatron's inference dispatcher)"
    return None


# The stages the pieces take over (stages.py): the layer's (0.16+) or the dispatcher's (0.13 to 0.15); on
# 0.12 the dispatcher's two methods, restated around the pieces for that release only (permutation_stages.py).
LAYER_STAGES = ("dispatch", "routed_experts_compute", "combine")
DISPATCHER_STAGES = ("token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine")
PERMUTATION_STAGES = ("token_permutation", "token_unpermutation")
PERMUTATION_RELEASE = (0, 12)
PERMUTATION_MODULE = "megatron.core.transformer.moe.token_dispatcher"
# What permutation_stages.py reads of 0.12's dispatcher beyond DISPATCHER_READS (set by its __init__).
PERMUTATION_READS = ("preprocess", "drop_and_pad", "shared_experts", "sort_input_by_local_experts",
                     "restore_output_by_local_experts", "num_experts")


def missing_stages(layer) -> str | None:
    """Which of Megatron's MoE stages this layer's objects lack (None: the pieces have theirs)."""
    if all(hasattr(layer, name) for name in LAYER_STAGES):
        return None
    dispatcher = layer.token_dispatcher
    absent = [name for name in DISPATCHER_STAGES if not hasattr(dispatcher, name)]
    if not absent:
        return None
    unpinned = permutation_reason(dispatcher.__class__, dispatcher)
    if unpinned is None:
        return None
    return (f"{type(dispatcher).__name__} has no {', '.join(absent)} and {type(layer).__name__} no "
            f"{' / '.join(LAYER_STAGES)}, and {unpinned}: no stage for the pieces to take over")


def permutation_reason(dispatcher_class, dispatcher=None) -> str | None:
    """Why 0.12's token_permutation / token_unpermutation are not taken over for this dispatcher (class);
    None: its class is 0.12's own, in a megatron-core 0.12 (permutation_stages.py restates its lines)."""
    found = megatron_version.release(megatron_version.imported().version)
    where = f"{dispatcher_class.__module__}.{dispatcher_class.__name__}"
    if (found != PERMUTATION_RELEASE or where != f"{PERMUTATION_MODULE}.MoEAlltoAllTokenDispatcher"
            or not all(name in vars(dispatcher_class) for name in PERMUTATION_STAGES)):
        release = ".".join(map(str, found)) if found else "unknown"
        return (f"its {' / '.join(PERMUTATION_STAGES)} are taken over only as megatron-core 0.12's own "
                f"MoEAlltoAllTokenDispatcher wrote them ({where}, megatron-core {release})")
    return None if dispatcher is None else _missing(dispatcher, PERMUTATION_READS)
