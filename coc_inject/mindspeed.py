"""Beside MindSpeed's patches: which of Megatron's attributes MindSpeed replaced, and by which feature.

MindSpeed's adaptor (``import mindspeed.megatron_adaptor``; read from its ``core_r0.12.1`` releases,
``mindspeed/features_manager/``) replaces Megatron's classes and functions at import, by
``MindSpeedPatchesManager``: ``setattr`` on Megatron's module (or class), and on every module of
``sys.modules`` that holds the same object. It imports the module first, so coc-inject's post-import
hook on that module runs *before* MindSpeed's ``setattr``; a wing therefore checks twice:

* at install, the attribute it would wrap (``attribute_feature``): where MindSpeed's is already
  there, the wing leaves it alone;
* at a layer's call or construction, the layer's class (``class_feature``): a class that MindSpeed
  put in Megatron's place (a subclass of Megatron's, defined in a ``mindspeed`` module) runs
  MindSpeed's code, and any call it makes into Megatron's wrapped method takes Megatron's path.

Either way the wing steps aside there with a line naming MindSpeed's feature (``aside``), so one
collective is never overlapped by both. Stdlib only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from coc_inject import log

LINEARS, ATTENTION, MULTI_COPY, MOE = "linears", "attention", "multi-copy", "moe"


@dataclass(frozen=True)
class Replacement:
    wing: str  # the coc-inject wing that would wrap the same attribute
    megatron: str  # the attribute MindSpeed replaces
    mindspeed: str  # what MindSpeed puts there
    feature: str  # MindSpeed's switch


_TP, _CP = "megatron.core.tensor_parallel", "mindspeed.core.context_parallel"
_MOE, _MS_MOE = "megatron.core.transformer.moe", "mindspeed.core.transformer.moe.moe_feature"
_UNALIGNED = "mindspeed.core.tensor_parallel.unaligned_layers.adaptor"

# MindSpeed core_r0.12.1 (2.1.0, 2.2.0, 2.3.0, 26.0.0, 26.1.0), mindspeed/features_manager/*: the replacements that touch
# what a coc-inject wing wraps. A class replacement is a subclass of Megatron's (MindSpeed's Impl
# first in the MRO, so its forward wins).
REPLACEMENTS = (
    Replacement(LINEARS, f"{_TP}.layers.ColumnParallelLinear",
                "mindspeed.core.tensor_parallel.coc_feature.adaptor.MindSpeedCoCColumnParallelLinear", "--use-ascend-coc"),
    Replacement(LINEARS, f"{_TP}.layers.RowParallelLinear",
                "mindspeed.core.tensor_parallel.coc_feature.adaptor.MindSpeedCoCRowParallelLinear", "--use-ascend-coc"),
    Replacement(LINEARS, f"{_TP}.layers.ColumnParallelLinear",
                "mindspeed.core.tensor_parallel.mc2_feature.adaptor.MindSpeedMC2ColumnParallelLinear", "--use-ascend-mc2"),
    Replacement(LINEARS, f"{_TP}.layers.RowParallelLinear",
                "mindspeed.core.tensor_parallel.mc2_feature.adaptor.MindSpeedMC2RowParallelLinear", "--use-ascend-mc2"),
    Replacement(ATTENTION, "megatron.core.transformer.dot_product_attention.DotProductAttention",
                f"{_CP}.adaptor.MindSpeedCPDotProductAttention", "--context-parallel-algo (context parallel size > 1)"),
    Replacement(ATTENTION, "megatron.core.transformer.attention.Attention.__init__",
                f"{_CP}.adaptor.attention_init_wrapper", "--context-parallel-size > 1"),
    Replacement(ATTENTION, "megatron.core.parallel_state.initialize_model_parallel",
                f"{_CP}.model_parallel_utils.initialize_model_parallel_cp_wrapper", "--context-parallel-algo"),
    Replacement(MOE, f"{_MOE}.moe_layer.MoELayer",
                f"{_MS_MOE}.adaptor.MindSpeedAlltoAllOverlapMoeLayerAdaptor", "--moe-alltoall-overlap-comm"),
    Replacement(MOE, f"{_MOE}.moe_layer.MoELayer",
                f"{_MS_MOE}.adaptor.MindSpeedAlltoAllSeqOverlapMoeLayerAdaptor", "--moe-alltoall-overlap-comm"),
    Replacement(MOE, f"{_MOE}.moe_layer.MoELayer",
                f"{_MS_MOE}.adaptor.MindSpeedAllGatherOverlapMoeLayerAdaptor", "--moe-allgather-overlap-comm"),
    Replacement(MOE, f"{_MOE}.moe_layer.MoELayer",
                f"{_MS_MOE}.adaptor.MindSpeedAlltoAllMC2MoeLayerAdaptor", "--moe-alltoall-mc2"),
    Replacement(MOE, f"{_MOE}.moe_layer.MoELayer",
                f"{_MS_MOE}.adaptor.MindSpeedAlltoAllSEQTptoEpMoELayer", "--moe-tp-extend-ep"),
    Replacement(MOE, f"{_MOE}.experts.GroupedMLP", f"{_MS_MOE}.adaptor.MindSpeedGmmExperts",
                "--moe-grouped-gemm (MindSpeed's grouped matmul experts)"),
    Replacement(MOE, f"{_MOE}.token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess",
                "mindspeed.core.fusions.fused_moe_permute.preprocess_sync_wrapper", "--moe-permute-fusion"),  # 2.3.0+
    Replacement(MOE, f"{_MOE}.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
                "mindspeed.core.fusions.fused_moe_permute.maybe_dtoh_and_synchronize", "--moe-permute-fusion"),  # 2.2.0+
    Replacement(MULTI_COPY, f"{_TP}.random.checkpoint", "mindspeed.core.tensor_parallel.random.checkpoint_wrapper",
                "--recompute-in-bubble / --recompute-in-advance (ripipe)"),
    Replacement(MULTI_COPY, f"{_TP}.mappings.reduce_scatter_to_sequence_parallel_region",
                "mindspeed.core.tensor_parallel.unaligned_layers", "--unaligned-linear"),
    Replacement(MULTI_COPY, "megatron.core.transformer.transformer_block.TransformerBlock.forward",
                "mindspeed.core.tensor_parallel.tp_2d.adaptor.mindspeed_transformer_block_forward_wrapper", "--tp-2d"),
    # 26.0 and later: TransformerEngineBasicFeature, on in every job (no switch), replaces the block's forward;
    # multi-copy reads that one as Megatron's (multi_copy/install.py READ_BLOCK_FORWARDS) and runs under it
    Replacement(MULTI_COPY, "megatron.core.transformer.transformer_block.TransformerBlock.forward",
                "mindspeed.te.pytorch.module.checkpoint.transformer_block_forward",
                "TransformerBlock.forward (its Transformer Engine basics, on by default from 26.0)"),
    Replacement(LINEARS, f"{_TP}.layers.ColumnParallelLinear",
                f"{_UNALIGNED}.UnalignedColumnParallelLinearAdaptor", "--unaligned-linear"),
    Replacement(LINEARS, f"{_TP}.layers.RowParallelLinear",
                f"{_UNALIGNED}.UnalignedRowParallelLinearAdaptor", "--unaligned-linear"),
    Replacement(ATTENTION, "megatron.core.transformer.dot_product_attention.DotProductAttention",
                "mindspeed.core.transformer.flash_attention.alibi.adaptor.MindSpeedDotProductAttention",
                "--position-embedding-type alibi (CP = 1)"),
    Replacement(ATTENTION, "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
                "mindspeed.core.transformer.flash_attention.flash_attention.adaptor.dot_product_attention_forward_impl",
                "--use-flash-attn (CP < 2)"),
)


def defined_in(obj) -> str:
    """The module that defined ``obj``'s code: a class's ``__module__``; a function's globals'
    ``__name__`` (a ``functools.wraps`` wrapper copies ``__module__`` from Megatron's function, not
    its globals)."""
    obj = getattr(obj, "__func__", obj)  # staticmethod / classmethod / bound method
    if isinstance(obj, type):
        return obj.__module__ or ""
    globals_ = getattr(obj, "__globals__", None)
    if isinstance(globals_, dict) and isinstance(globals_.get("__name__"), str):
        return globals_["__name__"]
    return getattr(obj, "__module__", None) or ""


def is_mindspeed(obj) -> bool:
    return defined_in(obj).split(".", 1)[0] == "mindspeed"


def _named(obj) -> str:
    obj = getattr(obj, "__func__", obj)
    return f"{defined_in(obj)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', type(obj).__name__))}"


def feature_of(obj, wing: str | None = None) -> str:
    """MindSpeed's feature that put ``obj`` there (the table's rows of ``wing``, or of any wing with None;
    else MindSpeed's object by name)."""
    name, module = _named(obj), defined_in(obj)
    for row in REPLACEMENTS:
        if wing is not None and row.wing != wing:
            continue
        if name == row.mindspeed or name.startswith(row.mindspeed + "."):
            return f"MindSpeed's {row.feature}"
        # a wrapper (functools.wraps) carries Megatron's name: known by the module that defined it
        if not isinstance(obj, type) and module in (row.mindspeed, row.mindspeed.rsplit(".", 1)[0]):
            return f"MindSpeed's {row.feature}"
    return f"MindSpeed's {name}"


def attribute_feature(owner, name: str, wing: str) -> str | None:
    """MindSpeed's feature when ``owner.name`` (a module's or a class's) is MindSpeed's, else None."""
    found = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if found is None or getattr(found, "__coc_inject__", False):
        return None
    if isinstance(found, type):
        return class_feature(found, wing)
    return feature_of(found, wing) if is_mindspeed(found) else None


_by_class: dict = {}  # (class, wing) -> feature or None


def class_feature(cls, wing: str) -> str | None:
    """MindSpeed's feature when ``cls`` (or a base of it) is MindSpeed's class, else None."""
    key = (cls, wing)
    if key not in _by_class:
        ours = next((base for base in cls.__mro__ if is_mindspeed(base)), None)
        _by_class[key] = None if ours is None else feature_of(ours, wing)
    return _by_class[key]


def reason(what: str, feature: str) -> str:
    return f"{what} is replaced by {feature}: coc-inject steps aside there (MindSpeed overlaps it)"


said: dict = {}  # wing -> the lines said (the banner's and status' "beside MindSpeed")


def aside(wing: str, what: str, feature: str) -> str:
    """Say once (rank 0 at info level) that ``wing`` steps aside on ``what``; the line."""
    line = f"{wing}: {reason(what, feature)}"
    if log.once(("mindspeed", wing, what), logging.INFO if log.global_rank() == 0 else logging.DEBUG, line):
        said.setdefault(wing, []).append(line)
    return line


def note(wing: str) -> str:
    """The banner's tail for ``wing``: what it left to MindSpeed ("" when nothing)."""
    lines = said.get(wing)
    return "" if not lines else "; beside MindSpeed: " + "; ".join(line.split(": ", 1)[1] for line in lines)


def forget() -> None:
    """Back to nothing said (tests)."""
    said.clear()
    _by_class.clear()
