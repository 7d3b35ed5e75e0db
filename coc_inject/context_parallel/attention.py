"""Megatron's local ``DotProductAttention`` with context parallelism (or, with COC_FLASH_ATTN at
CP = 1, the fused kernel alone): construction and forward.

Megatron's own ``__init__`` asserts ``context_parallel_size == 1``. The wrapped one decides the
layer's algorithm and checks everything the context-parallel path cannot do exactly (a clear
error naming the feature, never Megatron's bare assertion), then runs Megatron's ``__init__`` on
a copy of the config that says CP = 1 and puts the real config back: every other attribute is
Megatron's. The wrapped forward runs ``function.ContextParallelAttention`` over the CP group on
q/k/v in Megatron's CP layout and returns ``[s, b, heads * d]`` as Megatron's does. Every block
runs through the layer's attention kernel (coc_inject.attention_kernels), chosen once per call
shape.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import logging

import torch

from coc_inject import attention_kernels, log
from coc_inject.allowlist import check
from coc_inject.context_parallel import layout, masks
from coc_inject.context_parallel.function import ContextParallelAttention
from coc_inject.context_parallel.schedule import ALLGATHER, HYBRID, LOCAL, RING, ULYSSES, make_schedule
from coc_inject.settings.table import variable_for

# Megatron's cp_comm_type values (TransformerConfig, per layer) -> algorithm.
CP_COMM_TYPES = {None: RING, "p2p": RING, "a2a": ULYSSES, "a2a+p2p": HYBRID, "all_gather": ALLGATHER,
                 "allgather": ALLGATHER}
FOLLOW_MEGATRON = "megatron"


class ContextParallelError(ValueError):
    """A configuration or call the context-parallel attention cannot run exactly."""


AUTO = "auto"


@dataclass(frozen=True)
class Variant:
    """One way to run a layer: an algorithm with its sub-group sizes."""

    algorithm: str
    window: int = 1
    ulysses_degree: int = 1
    kv_repeats: int = 1  # K/V groups repeated so that the Ulysses all-to-all can split them
    ulysses_group: object = field(default=None, compare=False)  # the all-to-all group (ulysses, hybrid)

    def describe(self) -> str:
        if self.algorithm == LOCAL:
            return "local"
        if self.algorithm == RING and self.window > 1:
            return f"double-ring w={self.window}"
        if self.algorithm == HYBRID:
            return f"hybrid u={self.ulysses_degree}" + (f" w={self.window}" if self.window > 1 else "")
        return self.algorithm

    def settings(self) -> dict:
        """The COC_CP_* variables that run this variant without auto (None: must be unset)."""
        return {variable_for("cp_algo"): self.algorithm, variable_for("cp_window"): str(self.window),
                variable_for("cp_ulysses_degree"): str(self.ulysses_degree) if self.algorithm == HYBRID else None}


@dataclass
class LayerCP:
    """One layer's context-parallel plan, decided at construction: one variant, or the candidates of auto."""

    cp_size: int
    cp_group: object
    variants: tuple
    mask_type: str | None  # COC_CP_MASK_TYPE
    auto: bool = False
    kernel_preference: str = attention_kernels.AUTO  # COC_ATTN_KERNEL
    scale: float = 0.0  # set once Megatron's __init__ has computed it
    schedules: dict = field(default_factory=dict)  # (variant, causal) -> Schedule
    kernels: dict = field(default_factory=dict)  # (device type, dtype, head dim) -> attention_kernels.Choice

    @property
    def local(self) -> bool:
        """COC_FLASH_ATTN on a layer built with CP = 1: the fused kernel, no schedule."""
        return self.variants[0].algorithm == LOCAL

    @property
    def chunks(self) -> int:
        """Chunks of the whole sequence: Megatron's 2*CP, or one at CP = 1."""
        return 1 if self.local else 2 * self.cp_size

    def describe(self) -> str:
        if self.auto:
            return "auto among " + "/".join(v.describe() for v in self.variants)
        return self.variants[0].describe()


def unsupported_feature(megatron_config, attention_dropout) -> str | None:
    """What of the layer's configuration the fused attention path cannot run exactly (None: all of it):
    the config against context-parallel attention's allow-list (coc_inject/allowlist/context_parallel.py),
    the layer's own attention_dropout argument in place of the config's."""
    values = {} if attention_dropout is None else {"attention_dropout": attention_dropout}
    return check.refusal(megatron_config, check.CONTEXT_PARALLEL, values=values)


def plan_local(coc_config) -> LayerCP:
    """COC_FLASH_ATTN on a layer built with CP = 1 (checked by unsupported_feature first)."""
    return LayerCP(1, None, (Variant(LOCAL),), coc_config.cp_mask_type, kernel_preference=coc_config.attn_kernel)


def _cp_comm_type(value, layer_number: int):
    if isinstance(value, (list, tuple)):
        return value[layer_number - 1] if 0 < layer_number <= len(value) else None
    return value


def plan_layer(coc_config, megatron_config, layer_number: int, cp_comm_type, attention_dropout, cp_group,
               ulysses_group_of) -> LayerCP:
    """Decide the algorithm (or auto's candidates) and check what it needs; ContextParallelError
    names what cannot run."""
    n = megatron_config.context_parallel_size
    where = f"context parallelism (CP={n}) on Megatron's local DotProductAttention"
    comm_type = _cp_comm_type(cp_comm_type, layer_number)
    if coc_config.cp_algorithm == FOLLOW_MEGATRON:
        if comm_type not in CP_COMM_TYPES:
            raise ContextParallelError(f"{where}: cp_comm_type={comm_type!r} of layer {layer_number} is not "
                                       f"supported; expected one of {sorted(k for k in CP_COMM_TYPES if k)}")
        algorithm = CP_COMM_TYPES[comm_type]
    else:
        algorithm = coc_config.cp_algorithm
    feature = unsupported_feature(megatron_config, attention_dropout)
    if feature is not None:
        raise ContextParallelError(f"{where}: {feature}")
    if cp_group is None or cp_group.size() != n:
        raise ContextParallelError(f"{where}: Megatron's context-parallel group is missing or not of size {n} "
                                   "(was initialize_model_parallel called with context_parallel_size?)")
    if coc_config.cp_ulysses_degree is not None and algorithm not in (HYBRID, AUTO) \
            and coc_config.cp_algorithm != FOLLOW_MEGATRON:
        raise ContextParallelError(f"{where}: COC_CP_ULYSSES_DEGREE={coc_config.cp_ulysses_degree} is for "
                                   f"hybrid; the algorithm is {algorithm}")

    def variant(name, window):
        return _variant(name, window, coc_config, megatron_config, cp_group, ulysses_group_of, where)

    if algorithm != AUTO:
        return LayerCP(n, cp_group, (variant(algorithm, coc_config.cp_window),), coc_config.cp_mask_type,
                       kernel_preference=coc_config.attn_kernel)
    # auto: every algorithm the shape and the configured sub-group sizes allow (ring always).
    candidates = [(RING, 1), (RING, coc_config.cp_window), (ULYSSES, 1), (ALLGATHER, 1)]
    if coc_config.cp_ulysses_degree is not None or len(_hierarchical(megatron_config)) == 2:
        candidates.append((HYBRID, coc_config.cp_window))
    variants = []
    for name, window in dict.fromkeys(candidates):
        try:
            variants.append(variant(name, window))
        except ContextParallelError:
            if name == RING and window == 1:
                raise
    return LayerCP(n, cp_group, tuple(variants), coc_config.cp_mask_type, auto=True,
                   kernel_preference=coc_config.attn_kernel)


def _variant(algorithm, window, coc_config, megatron_config, cp_group, ulysses_group_of, where) -> Variant:
    n = megatron_config.context_parallel_size
    degree = 1
    if algorithm == ULYSSES:
        degree = n
    elif algorithm == HYBRID:
        degree = _hybrid_degree(coc_config, megatron_config, where)
    ring_size = n // degree
    if window > 1 and (algorithm in (ULYSSES, ALLGATHER) or window >= ring_size or ring_size % window):
        raise ContextParallelError(
            f"{where}: COC_CP_WINDOW={window} (--cp-window-size) does not fit the {algorithm} schedule: a window "
            f"needs a ring (ring or hybrid) of more than w ranks that w divides (ring size here: {ring_size})")

    tp = megatron_config.tensor_model_parallel_size
    heads, groups = megatron_config.num_attention_heads, megatron_config.num_query_groups or \
        megatron_config.num_attention_heads
    kv_repeats = 1
    if degree > 1:
        heads_local, groups_local = heads // tp, groups // tp
        kv_repeats = next((r for r in range(1, heads_local // groups_local + 1)
                           if (groups_local * r) % degree == 0 and heads_local % (groups_local * r) == 0), None)
        if heads_local % degree or kv_repeats is None:
            raise ContextParallelError(
                f"{where}: {algorithm} splits the heads of each tensor-parallel rank over {degree} ranks, but "
                f"num_attention_heads={heads}, num_query_groups={groups} with TP={tp} leave {heads_local} heads "
                f"and {groups_local} key/value groups per rank; the heads per rank must divide by {degree} "
                "(choose ring or allgather, or another CP size)")
    ulysses_group = None
    if algorithm == HYBRID:
        ulysses_group = ulysses_group_of(degree)
        if ulysses_group is None:
            raise ContextParallelError(
                f"{where}: hybrid's Ulysses groups of {degree} ranks do not exist; coc-inject makes them when "
                "initialize_model_parallel runs (was it called before Megatron was imported with coc-inject "
                "armed?), or set hierarchical_context_parallel_sizes")
    elif algorithm == ULYSSES:
        ulysses_group = cp_group
    return Variant(algorithm, window, degree, kv_repeats, ulysses_group)


def _hierarchical(megatron_config) -> list:
    return list(getattr(megatron_config, "hierarchical_context_parallel_sizes", None) or [])


def _hybrid_degree(coc_config, megatron_config, where) -> int:
    n = megatron_config.context_parallel_size
    if not any(n % u == 0 for u in range(2, n)):  # CP 2, 3 or any prime: no Ulysses degree can split it
        chosen = ("cp_comm_type='a2a+p2p' with COC_CP_ALGO=megatron" if coc_config.cp_algorithm == FOLLOW_MEGATRON
                  else f"COC_CP_ALGO={coc_config.cp_algorithm}")
        raise ContextParallelError(f"{where}: {chosen}: hybrid needs CP >= 4, a context-parallel size that a Ulysses "
                                   f"degree u (1 < u < CP) divides; CP={n} has none: choose ring, ulysses or "
                                   "allgather here, or hybrid with CP >= 4 (e.g. CP=4, COC_CP_ULYSSES_DEGREE=2)")
    hierarchical = _hierarchical(megatron_config)
    from_megatron = hierarchical[0] if len(hierarchical) == 2 else None
    degree = coc_config.cp_ulysses_degree or from_megatron
    if degree is None:
        raise ContextParallelError(f"{where}: hybrid needs its Ulysses group size: set COC_CP_ULYSSES_DEGREE "
                                   "(--ulysses-degree-in-cp) or hierarchical_context_parallel_sizes=[u, CP/u]")
    if from_megatron is not None and coc_config.cp_ulysses_degree not in (None, from_megatron):
        raise ContextParallelError(f"{where}: COC_CP_ULYSSES_DEGREE={coc_config.cp_ulysses_degree} disagrees with "
                                   f"hierarchical_context_parallel_sizes={hierarchical}")
    if not (1 < degree < n and n % degree == 0):
        raise ContextParallelError(f"{where}: hybrid's Ulysses degree {degree} must be > 1, < CP={n} and divide "
                                   "it (COC_CP_ULYSSES_DEGREE / --ulysses-degree-in-cp)")
    return degree


def is_causal(plan: LayerCP, layer_mask_type, attention_mask, q_ids, chunk_len: int,
              mask_ignored: bool = False) -> bool:
    """Causal or no mask, as Megatron's local attention would apply it; any other mask is an error.

    A mask tensor decides when given and Megatron's softmax applies it; ``mask_ignored``
    (masks.megatron_ignores_mask: its fused causal kernel would run) leaves it unread, as Megatron
    does. Without one the layer's mask type does (COC_CP_MASK_TYPE=general: no mask).
    """
    name = getattr(layer_mask_type, "name", str(layer_mask_type))
    if plan.mask_type == "causal" and name != "causal":
        raise ContextParallelError(f"--attention-mask-type causal / COC_CP_MASK_TYPE=causal disagrees with the "
                                   f"layer's mask type {name}")
    if name not in ("causal", "no_mask", "padding"):
        raise ContextParallelError(f"context parallelism on the local attention supports causal and no-mask "
                                   f"attention, not the mask type {name}")
    if attention_mask is not None and not mask_ignored:
        return _mask_is_causal(plan, attention_mask, q_ids, chunk_len)
    return name == "causal" and plan.mask_type != "general"


def _mask_is_causal(plan: LayerCP, mask, q_ids, chunk_len: int) -> bool:
    """True for a causal mask, False for one that hides nothing; rows ``[b|1, 1, s/CP, s]`` (this rank's,
    Megatron's CP split) or ``[b|1, 1, s, s]``. Read once per mask tensor (masks.classify)."""
    rows, cols = mask.shape[-2:]
    seq = chunk_len * plan.chunks
    if mask.dim() != 4 or mask.shape[1] != 1 or cols != seq or rows not in (seq, len(q_ids) * chunk_len):
        raise ContextParallelError(f"attention mask of shape {list(mask.shape)}: context parallelism expects "
                                   f"[b|1, 1, {len(q_ids) * chunk_len}, {seq}] (this rank's rows, Megatron's CP "
                                   f"split) or [b|1, 1, {seq}, {seq}]")
    kind = masks.classify(mask, (0,), seq, seq) if rows == seq else masks.classify(mask, q_ids, chunk_len, seq)
    if kind not in (masks.CAUSAL, masks.NONE):
        raise ContextParallelError(
            "the attention mask is neither causal nor empty: context parallelism on the local attention "
            "supports causal and no-mask attention only (padding or document masks: Transformer Engine)")
    return kind == masks.CAUSAL


def schedule_for(plan: LayerCP, variant: Variant, causal: bool):
    schedule = plan.schedules.get((variant, causal))
    if schedule is None:
        schedule = plan.schedules[(variant, causal)] = make_schedule(
            variant.algorithm, plan.cp_group, causal=causal, scale=plan.scale, window=variant.window,
            ulysses_group=variant.ulysses_group, ulysses_size=variant.ulysses_degree)
    return schedule


def kernel_for(plan: LayerCP, query, layer_name: str) -> attention_kernels.Choice:
    """The layer's attention kernel for this call's device, dtype and head dim (decided once per
    shape; a fallback to the reference kernel says why, once)."""
    shape = (query.device.type, query.dtype, query.shape[-1])
    choice = plan.kernels.get(shape)
    if choice is None:
        try:
            choice = attention_kernels.choose(plan.kernel_preference, *shape)
        except attention_kernels.KernelUnavailable as exc:
            raise ContextParallelError(f"{layer_name}: {exc}") from None
        plan.kernels[shape] = choice
        if choice.fallback_reason is not None and plan.kernel_preference != attention_kernels.REFERENCE:
            log.once(("attention-kernel-fallback", choice.fallback_reason), logging.WARNING,
                     f"attention on {shape[0]} in {str(shape[1]).removeprefix('torch.')}, head dim {shape[2]} runs "
                     f"the reference kernel (tiled fp32 torch ops, slower): {choice.fallback_reason}")
    return choice


def run(plan: LayerCP, variant: Variant, query, key, value, causal: bool, kernel):
    """[s, b, heads, d] q and [s, b, groups, d] k/v (this rank's rows) -> [s, b, heads, d], every
    block through ``kernel`` (kernel_for's choice)."""
    if variant.kv_repeats > 1:
        key = key.repeat_interleave(variant.kv_repeats, dim=2)
        value = value.repeat_interleave(variant.kv_repeats, dim=2)
    return ContextParallelAttention.apply(query, key, value, schedule_for(plan, variant, causal), kernel)


def mask_is_causal(plan: LayerCP, query, attention_mask, mask_type, layer=None) -> bool:
    """Causal or not for this call (errors for what cannot run); checks the rows too. ``layer``:
    Megatron's attention, whose softmax may ignore the mask (masks.megatron_ignores_mask)."""
    s = query.shape[0]
    ignored = attention_mask is not None and layer is not None \
        and masks.megatron_ignores_mask(layer, query.shape[1], s * (1 if plan.local else plan.cp_size))
    if plan.local:
        return is_causal(plan, mask_type, attention_mask, (0,), s, ignored)
    if s % 2:
        raise ContextParallelError(f"context parallelism needs the sequence in 2*CP chunks (Megatron's "
                                   f"get_batch_on_this_cp_rank); this rank holds {s} rows, an odd number")
    return is_causal(plan, mask_type, attention_mask, layout.rank_chunks(plan.cp_group.rank(), plan.cp_size), s // 2,
                     ignored)


def megatron_init(original_init, arguments: inspect.BoundArguments, layer) -> None:
    """Run Megatron's __init__ (``arguments`` bound to its signature) with a CP=1 copy of the config,
    then give the layer the real config back."""
    config = arguments.arguments["config"]
    proxy = copy.copy(config)
    proxy.context_parallel_size = 1
    arguments.arguments["config"] = proxy
    try:
        original_init(*arguments.args, **arguments.kwargs)
    finally:
        arguments.arguments["config"] = config
    layer.config = config
