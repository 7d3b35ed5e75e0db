"""Configuration from environment variables (and MindSpeed-style flags), validated up front.

Everything here is pure stdlib and cheap to import: the interpreter bootstrap reads the
config before torch is imported, and a bad value must fail loudly at start-up, not
silently turn CoC off halfway through a multi-node job.

Sources, strongest first: environment variables, then the ``COC_CONFIG`` JSON file, then
MindSpeed's ``--use-ascend-coc`` flags (only where the matching variable is unset; a
disagreement is an error), then the :class:`CocConfig` defaults.

Each setting is one row of :mod:`coc_inject.settings.table`; this module gathers the names the
rest of the package (and its tests) use.
"""

from __future__ import annotations

from coc_inject.settings.argv import extract_cp_flags, extract_mindspeed_flags
from coc_inject.settings.coc_config import CocConfig
from coc_inject.settings.parsers import (
    AUTO,
    SHAPE_COUNT_ALLOWED,
    SHAPE_KEY_ALLOWED,
    ConfigError,
    parse_customized,
    parse_tune_cache,
    parse_tune_candidates,
)
from coc_inject.settings.parsers import shape_text as _shape_text  # noqa: F401  (tune/report.py's name)
from coc_inject.settings.resolve import load_config, unknown_variables, validate_all
from coc_inject.settings.table import ATTN_KERNELS, ENV_REFERENCE, FILE_REFERENCE, FUSED_BACKENDS, LOG_LEVELS

__all__ = [
    "ATTN_KERNELS", "AUTO", "ENV_REFERENCE", "FILE_REFERENCE", "FUSED_BACKENDS", "LOG_LEVELS", "SHAPE_COUNT_ALLOWED",
    "SHAPE_KEY_ALLOWED", "CocConfig", "ConfigError", "extract_cp_flags", "extract_mindspeed_flags", "load_config",
    "parse_customized", "parse_tune_cache", "parse_tune_candidates", "unknown_variables", "validate_all",
]
