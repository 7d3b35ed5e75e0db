"""The rules that span several settings, each stated once.

CocConfig and the resolution of the environment, the config file and MindSpeed's flags both
apply them, each phrasing the error for its own source.
"""

from __future__ import annotations

from coc_inject.settings.parsers import ConfigError


def linears_on(fused, parallel_num, customized_coc) -> bool:
    """Are the linears' CoC on (before COC_DISABLE): the fused kernel, a chunk count other than
    1 (= off), or a per-shape count other than 1?"""
    return bool(fused or parallel_num != 1 or any(chunks != 1 for _, chunks in customized_coc))


def k_range_error(k_min, k_max, file_where: str | None = None) -> ConfigError | None:
    """matmul_soc_friendly's k range [k_min, k_max] must not be empty: the error, phrased for the
    config file ``file_where`` (``COC_CONFIG=<path>``) or, without one, for CocConfig."""
    if k_min <= k_max:
        return None
    if file_where is None:
        return ConfigError("CocConfig.k_min", k_min, f"k_min <= k_max (k_max is {k_max})")
    return ConfigError(f"{file_where}: keys 'k_min', 'k_max'", f"{k_min} > {k_max}", "k_min <= k_max")


# What a refinement (a table row's ``needs``) needs switched on, since without it the refinement
# would do nothing: (is it on in the resolved values, what to set too, the reason given).
CONTEXT_PARALLELISM = "context parallelism"
ATTENTION = "coc-inject's attention"
MEASURING = "measuring"
TRACING = "tracing"


def _linears_on(values) -> bool:
    return linears_on(values.get("fused"), values.get("parallel_num", 1), values.get("customized_coc", ()))


SWITCHED_ON = {
    CONTEXT_PARALLELISM: (
        lambda values: values.get("cp_algo") is not None or _linears_on(values),
        "COC_CP_ALGO (or --context-parallel-algo) set too, or CoC on (then the algorithm follows Megatron's "
        "cp_comm_type)",
        "is given but context parallelism is not switched on"),
    ATTENTION: (
        lambda values: values.get("cp_algo") is not None or bool(values.get("flash_attn")) or _linears_on(values),
        "COC_CP_ALGO or COC_FLASH_ATTN=1 set too (or CoC on: then the context-parallel algorithm follows "
        "Megatron's cp_comm_type)",
        "is given but no attention of coc-inject's is switched on"),
    MEASURING: (
        lambda values: values.get("measure") is not None or values.get("trace_dir") is not None,
        "COC_MEASURE=1 (or a step range) or COC_TRACE set too",
        "is given but nothing is measured"),
    TRACING: (
        lambda values: values.get("trace_dir") is not None,
        "COC_TRACE=DIR set too",
        "is given but no trace is written"),
}


def refinement_error(needs: str, given: str, values: dict, field: str, text: str | None = None) -> ConfigError | None:
    """The error for a refinement (``values[field]``, given as ``given``, its text ``text`` where it was
    typed: a step range reads as the user wrote it, not as its parsed pair) whose switch is off."""
    switched_on, what_else, reason = SWITCHED_ON[needs]
    if values.get("disabled") or switched_on(values):
        return None
    return ConfigError(given, values[field] if text is None else text, what_else, reason=reason)
