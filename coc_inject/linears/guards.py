"""The guards of the linears' wing: when a Row / Column call must take Megatron's own path.

A call goes through CoC only when every feature it uses is honoured; each guard here names the
feature it found, as the MegatronPath's reason (logged once, counted by the coverage). GUARDS
lists the features of newer megatron-core releases that are checked (``coc-inject status``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from coc_inject.allowlist import check
from coc_inject.routes import MegatronPath


@dataclass(frozen=True)
class Guard:
    """A Megatron feature the engine checks for, because ignoring it would give a wrong result."""

    feature: str
    since: tuple  # first megatron-core (major, minor) that has it
    handling: str


GUARDS = (
    Guard("tensor-parallel weight sharding (gtp_remat_size > 1)", (0, 19),
          "Megatron's path: layer.weight is a shard that Megatron gathers before the matmul"),
    Guard("output_dtype on ColumnParallelLinear", (0, 20),
          "Megatron's path when it differs from the input dtype (the GEMM writes another dtype)"),
    Guard("inference-optimized output all-gather (eval, gather_output)", (0, 18),
          "handled: CoC's output is gathered by Megatron's inference all-gather"),
    Guard("Megatron-FSDP parameters (__fsdp_param__) with gradient_accumulation_fusion", (0, 14),
          "handled: wgrad is written into weight.get_main_grad(), as Megatron does"),
    Guard("weight of another shape than the one CoC multiplies by", (0, 13),
          "Megatron's path"),
)


# The reasons that do not depend on the call: made once (a path is counted at every call it takes).
TP_SIZE_1 = MegatronPath("tensor-parallel size 1: no collective to overlap", expected=True)
EXPERT_LAYER = MegatronPath("expert layer: its communication is done by the MoE token dispatcher", expected=True)
CPU_OFFLOADING = MegatronPath("activation CPU offloading is active for this call")
UNKNOWN_ARGUMENTS = MegatronPath("unknown forward arguments (newer Megatron?)")
NO_GRAD_REDUCE = MegatronPath("disable_grad_reduce: the caller reduces gradients itself", expected=True)
NO_WEIGHT = MegatronPath("no weight supplied (skip_weight_param_allocation)")
COLUMN_WITHOUT_SP = MegatronPath(
    "no sequence parallelism: forward has no communication and Megatron already overlaps the backward "
    "all-reduce with wgrad (COC_ENABLE_IN_COLUMN_BACKWARD=1 chunks it)", expected=True)


# What each forward reads of its layer without a default: a layer lacking one (a megatron-core release
# outside the tested range, COC_ALLOW_UNTESTED_MEGATRON=1) takes Megatron's path, naming it.
ROW_READS = ("config", "weight", "bias", "input_size_per_partition", "output_size", "sequence_parallel",
             "input_is_parallel", "skip_bias_add", "gradient_accumulation_fusion")
COLUMN_READS = ("config", "weight", "bias", "input_size", "output_size_per_partition", "sequence_parallel",
                "gather_output", "skip_bias_add", "gradient_accumulation_fusion")


def _missing(layer, names) -> MegatronPath | None:
    for name in names:
        if not hasattr(layer, name):
            return MegatronPath(f"{type(layer).__name__} has no attribute {name!r} (a megatron-core release "
                                "coc-inject does not know)")
    if tp_group(layer) is NO_GROUP:
        return MegatronPath(f"{type(layer).__name__} has no attribute 'tp_group' (a megatron-core release "
                            "coc-inject does not know)")
    return None


NO_GROUP = object()


def tp_group(layer):
    """The layer's tensor-parallel group: its ``tp_group`` (megatron-core >= 0.13); before 0.13 the
    layers have none and their forwards use parallel_state's TP group, returned here. NO_GROUP when
    a layer of a later release has none."""
    try:
        return layer.tp_group
    except AttributeError:
        if not _before_013():
            return NO_GROUP
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def group_argument(layer) -> dict:
    """The ``group=`` keyword of Megatron's TP mappings (0.12's take none: parallel_state's group)."""
    return {"group": layer.tp_group} if hasattr(layer, "tp_group") else {}


@functools.lru_cache(maxsize=1)
def _before_013() -> bool:
    from coc_inject import megatron_version

    found = megatron_version.release(megatron_version.imported().version)
    return found is not None and found < (0, 13)


def _refused(layer, kind: str) -> MegatronPath | None:
    """The allow-list's reason for this layer's config (coc_inject/allowlist), as a MegatronPath."""
    why = check.refusal(layer.config, check.LINEARS, kind=kind)
    return None if why is None else MegatronPath(why)


def _weight_fallback(layer, weight, expected: tuple) -> MegatronPath | None:
    gtp = getattr(layer, "gtp_remat_size", 1)
    if isinstance(gtp, int) and gtp > 1:
        return MegatronPath(f"tensor-parallel weight sharding (gtp_remat_size={gtp}): the weight is a shard "
                        "Megatron gathers before the matmul")
    if weight is not None and tuple(weight.shape) != expected:
        return MegatronPath(f"weight shape {tuple(weight.shape)} is not the [{expected[0]}, {expected[1]}] "
                        "this layer multiplies by")
    return None


def _layer_fallback(layer) -> MegatronPath | None:
    """What of the layer's construction sends every call to Megatron's path (decided once per layer)."""
    group = tp_group(layer)
    tp_size = group.size() if group is not None else 1
    if tp_size <= 1:
        return TP_SIZE_1
    if getattr(layer, "explicit_expert_comm", False):
        return EXPERT_LAYER
    return None


def _call_fallback(layer, input_: torch.Tensor) -> MegatronPath | None:
    offload = getattr(layer.config, "_cpu_offloading_context", None)
    if offload is not None and getattr(offload, "inside_context", False):
        return CPU_OFFLOADING
    if not input_.is_floating_point():
        return MegatronPath(f"input dtype {input_.dtype} is not floating point")
    return None


def row_layer_guards(layer) -> MegatronPath | None:
    """Why every call of this RowParallelLinear takes Megatron's path, whatever its input (None: it may
    not): its construction, config and group (linears/forward.py keeps it on the layer, coc_inject.verdicts)."""
    return _missing(layer, ROW_READS) or _refused(layer, "row") or _layer_fallback(layer)


def column_layer_guards(config, layer) -> MegatronPath | None:
    """Why every call of this ColumnParallelLinear takes Megatron's path, whatever its input, or None."""
    path = _missing(layer, COLUMN_READS) or _refused(layer, "column") or _layer_fallback(layer)
    if path is not None:
        return path
    if getattr(layer, "disable_grad_reduce", False):
        return NO_GRAD_REDUCE
    if not layer.sequence_parallel and not config.enable_coc_in_column_backward:
        return COLUMN_WITHOUT_SP
    return None


def row_call_guards(layer, input_, args, kwargs) -> MegatronPath | None:
    """Why this call of a RowParallelLinear whose layer passed row_layer_guards takes Megatron's path, or None."""
    if args or kwargs:
        return UNKNOWN_ARGUMENTS
    path = _call_fallback(layer, input_) or _weight_fallback(
        layer, layer.weight, (layer.output_size, layer.input_size_per_partition))
    if path is None and layer.sequence_parallel and input_.shape[0] % tp_group(layer).size():
        path = MegatronPath(f"sequence length {input_.shape[0]} is not divisible by TP")
    return path


def column_call_guards(layer, input_, weight, args, kwargs) -> MegatronPath | None:
    """Why this call of a ColumnParallelLinear whose layer passed column_layer_guards takes Megatron's path."""
    if args or kwargs:
        return UNKNOWN_ARGUMENTS
    path = _call_fallback(layer, input_)
    if path is not None:
        return path
    output_dtype = getattr(layer, "output_dtype", None)
    if output_dtype is not None and output_dtype != input_.dtype:
        return MegatronPath(f"output_dtype {output_dtype} differs from the input dtype {input_.dtype}")
    matrix = layer.weight if weight is None else weight
    if matrix is None:
        return NO_WEIGHT
    return _weight_fallback(layer, matrix, (layer.output_size_per_partition, layer.input_size))


def row_guards(layer, input_, args, kwargs) -> MegatronPath | None:
    """Why a RowParallelLinear call must take Megatron's path, or None (the layer's guards, then the call's)."""
    return row_layer_guards(layer) or row_call_guards(layer, input_, args, kwargs)


def column_guards(config, layer, input_, weight, args, kwargs) -> MegatronPath | None:
    """Why a ColumnParallelLinear call must take Megatron's path, or None."""
    return column_layer_guards(config, layer) or column_call_guards(layer, input_, weight, args, kwargs)
