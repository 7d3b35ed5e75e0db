"""Configuration from environment variables (and MindSpeed-style flags), validated up front.

Everything here is pure stdlib and cheap to import: the interpreter bootstrap reads the
config before torch is imported, and a bad value must fail loudly at start-up, not
silently turn CoC off halfway through a multi-node job.

Sources, strongest first: environment variables, then the ``COC_CONFIG`` JSON file, then
MindSpeed's ``--use-ascend-coc`` flags (only where the matching variable is unset; a
disagreement is an error), then the :class:`CocConfig` defaults.

Every user-visible "allowed" text lives in :data:`ENV_REFERENCE` / :data:`FILE_REFERENCE`;
the parser, the CLI and the README table all read them from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

LOG_LEVELS = ("debug", "info", "warning", "error")

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """One invalid setting. ``str()`` is a single line naming the setting, its value and what is allowed.

    ``variable`` names where the value came from: an environment variable
    (``COC_PARALLEL_NUM``), a key in the config file (``COC_CONFIG=/p/x.json: key 'k_min'``)
    or a command-line flag (``--coc-parallel-num``).
    """

    def __init__(self, variable: str, value, allowed: str, *, reason: str = "is invalid", message: str | None = None):
        self.variable = variable
        self.value = value
        self.allowed = allowed
        self.reason = reason
        if message is None:
            message = f"{variable}={value!r} {reason}: expected {allowed}"
        # One line, always: these end up in per-rank log prefixes and CLI tables.
        super().__init__(" ".join(message.splitlines()))

    def __reduce__(self):
        # The default pickling replays ``self.args`` (just the message) into __init__, which
        # would fail; errors raised in worker processes must survive being sent back.
        return (_rebuild_config_error, (self.variable, self.value, self.allowed, self.reason, str(self)))


def _rebuild_config_error(variable, value, allowed, reason, message):
    return ConfigError(variable, value, allowed, reason=reason, message=message)


# --- reference: the single source of every name, default and "allowed" text -------------


@dataclass(frozen=True)
class Setting:
    """One documented setting: what to set, its default, what it accepts and what it does."""

    name: str
    default: str
    allowed: str
    meaning: str


BOOL_ALLOWED = "1/0, true/false, yes/no, on/off (any case)"
POSITIVE_INT_ALLOWED = "an integer >= 1"
# The chunk count "auto": tuned per shape at run time (coc_inject.tuning). Stored as -2, a
# value no user can type as a count.
AUTO = -2
PARALLEL_NUM_ALLOWED = f"{POSITIVE_INT_ALLOWED} (1 = off), or auto (tuned per shape at run time)"
SHAPE_KEY_ALLOWED = 'a string "[m, k, n]" holding a JSON list of three integers >= 1'
SHAPE_COUNT_ALLOWED = ('an integer >= 1, -1 (fused for that shape) or "auto" (tuned for that shape); '
                       "1 = off for that shape")
TUNE_CANDIDATES_ALLOWED = "a comma-separated list of distinct integers >= 2 (chunk counts), e.g. 2,4,8"
TUNE_CACHE_ALLOWED = "an absolute file path, or off (no cache)"
CUSTOMIZED_ALLOWED = (
    'a JSON object {"[m, k, n]": chunks} mapping matmul shapes to chunk counts; '
    f"keys: {SHAPE_KEY_ALLOWED}; values: {SHAPE_COUNT_ALLOWED}"
)
LOG_LEVEL_ALLOWED = ", ".join(LOG_LEVELS) + " (any case)"
# Kept in step with coc_inject.fused.registry.CHOICES (a test checks); this module stays torch-free.
FUSED_BACKENDS = ("auto", "chunked", "atb", "mc2", "symm_mem")
FUSED_BACKEND_ALLOWED = ", ".join(FUSED_BACKENDS) + " (any case)"
REPORT_ALLOWED = "a file path (its directory must be writable); {rank} is replaced by the global rank"
# Context parallelism on Megatron's local attention (coc_inject.context_parallel).
CP_ALGOS = ("ring", "ulysses", "hybrid", "allgather", "megatron", "auto")
# MindSpeed's --context-parallel-algo names, and Megatron's spelling of all-gather.
CP_ALGO_ALIASES = {"megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses", "hybrid_cp_algo": "hybrid",
                   "all_gather": "allgather"}
CP_ALGO_ALLOWED = ("ring, ulysses, hybrid, allgather, megatron (each layer's cp_comm_type: p2p = ring, "
                   "a2a = ulysses, a2a+p2p = hybrid, all_gather = allgather) or auto (tried per attention shape "
                   "at run time); MindSpeed's megatron_cp_algo (= ring), ulysses_cp_algo, hybrid_cp_algo (any case)")
CP_WINDOW_ALLOWED = ("an integer >= 1: 1 = ring; w > 1 = Double-Ring with inner rings of w ranks "
                     "(w < the ring's size, w divides it)")
CP_ULYSSES_ALLOWED = "an integer >= 2 that divides the context-parallel size and is smaller than it"
CP_MASK_TYPES = ("causal", "general")
CP_MASK_ALLOWED = ("causal or general (any case): causal = the layer's mask is causal (no mask tensor, or a causal "
                   "one); general = the mask tensor decides (none = no mask, a causal one = causal)")
# The attention kernel (coc_inject.attention_kernels.PREFERENCES; this module stays torch-free).
ATTN_KERNELS = ("auto", "fused", "reference")
ATTN_KERNEL_ALLOWED = ("auto, fused or reference (any case): auto = the device's fused flash-attention kernel, the "
                       "reference kernel where none can run a call (said once); fused = only the fused kernel (an "
                       "error where none can run); reference = tiled fp32 torch ops (the test oracle)")
FLAG_NEEDS_USE_ASCEND_COC = "--use-ascend-coc alongside it (MindSpeed only honours the CoC flags with --use-ascend-coc)"


def _shown(default) -> str:
    """Render a dataclass default the way a user would type it in the environment."""
    if isinstance(default, bool):
        return "true" if default else "false"
    if default == ():
        return "{}"
    return str(default)


def _is_int(value) -> bool:
    # JSON true/false arrive as bool, which is an int subclass; they are not chunk counts.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_valid_chunk_count(value) -> bool:
    return _is_int(value) and (value >= 1 or value in (-1, AUTO))


def _chunk_count_from_json(value):
    """A customized_coc value as stored: "auto" (any case) becomes AUTO; a typed AUTO stays invalid."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    return None if value == AUTO else value


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --- the configuration itself ----------------------------------------------------------


@dataclass(frozen=True)
class CocConfig:
    """The resolved CoC settings of one process. Frozen and hashable, so it can key caches."""

    parallel_num: int = 1
    fused: bool = False
    recompute_all_gather: bool = True
    enable_coc_in_column_backward: bool = False
    matmul_soc_friendly: bool = True
    # Sorted tuple of ((m, k, n), chunks) pairs; a dict is accepted and normalised.
    customized_coc: tuple = ()
    k_min: int = 1024
    k_max: int = 4096
    log_level: str = "info"
    disabled: bool = False
    config_file: str | None = None
    fused_backend: str = "auto"
    deterministic: bool = False
    # COC_PARALLEL_NUM=auto: the CoC chunk counts tried beside Megatron's own path (N=1).
    tune_candidates: tuple = (2, 4, 8)
    # Where auto decisions persist (None: no cache). Process-local (ranks agree on each
    # decision), so not part of equality.
    tune_cache: str | None = field(default=None, compare=False)
    # Process-local (not agreed across ranks): patch a megatron-core outside the tested range.
    allow_untested_megatron: bool = False
    # Process-local: where each rank writes its coverage report at exit (None: no report).
    report: str | None = None
    # Context parallelism on the local attention; None: not set (see cp_algorithm).
    cp_algo: str | None = None
    cp_window: int = 1
    cp_ulysses_degree: int | None = None
    cp_mask_type: str | None = None
    # The block kernel of coc-inject's attention (CP and COC_FLASH_ATTN); fused attention at CP = 1.
    attn_kernel: str = "auto"
    flash_attn: bool = False

    def __post_init__(self):
        # Built by hand (tests, other modules) as well as by load_config, so normalise and
        # check the few things that would otherwise fail far from their cause.
        where = "CocConfig"
        pairs = self.customized_coc.items() if isinstance(self.customized_coc, dict) else self.customized_coc
        normalised = []
        for shape, chunks in pairs:
            shape = tuple(shape)
            if len(shape) != 3 or not all(_is_int(d) and d >= 1 for d in shape):
                raise ConfigError(f"{where}.customized_coc key", shape, SHAPE_KEY_ALLOWED)
            if not _is_valid_chunk_count(chunks):
                raise ConfigError(f"{where}.customized_coc[{shape!r}]", chunks, SHAPE_COUNT_ALLOWED)
            normalised.append((shape, chunks))
        chunks_by_shape = dict(normalised)
        if len(chunks_by_shape) != len(normalised):
            raise ConfigError(f"{where}.customized_coc", normalised, "each shape at most once")
        object.__setattr__(self, "customized_coc", tuple(sorted(normalised)))
        # Not a field (so not compared, hashed or fingerprinted): a lookup table for chunks_for.
        object.__setattr__(self, "_chunks_by_shape", chunks_by_shape)
        if not (_is_int(self.parallel_num) and (self.parallel_num >= 1 or self.parallel_num == AUTO)):
            raise ConfigError(f"{where}.parallel_num", self.parallel_num, PARALLEL_NUM_ALLOWED)
        candidates = tuple(self.tune_candidates)
        if not candidates or len(set(candidates)) != len(candidates) or not all(
                _is_int(c) and c >= 2 for c in candidates):
            raise ConfigError(f"{where}.tune_candidates", self.tune_candidates, TUNE_CANDIDATES_ALLOWED)
        object.__setattr__(self, "tune_candidates", tuple(sorted(candidates)))
        for name in ("k_min", "k_max"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise ConfigError(f"{where}.{name}", getattr(self, name), POSITIVE_INT_ALLOWED)
        if self.k_min > self.k_max:
            raise ConfigError(f"{where}.k_min", self.k_min, f"k_min <= k_max (k_max is {self.k_max})")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{where}.log_level", self.log_level, ", ".join(LOG_LEVELS))
        if self.fused_backend not in FUSED_BACKENDS:
            raise ConfigError(f"{where}.fused_backend", self.fused_backend, ", ".join(FUSED_BACKENDS))
        if self.cp_algo is not None and self.cp_algo not in CP_ALGOS:
            raise ConfigError(f"{where}.cp_algo", self.cp_algo, CP_ALGO_ALLOWED)
        if not (_is_int(self.cp_window) and self.cp_window >= 1):
            raise ConfigError(f"{where}.cp_window", self.cp_window, CP_WINDOW_ALLOWED)
        if self.cp_ulysses_degree is not None and not (_is_int(self.cp_ulysses_degree) and self.cp_ulysses_degree >= 2):
            raise ConfigError(f"{where}.cp_ulysses_degree", self.cp_ulysses_degree, CP_ULYSSES_ALLOWED)
        if self.cp_mask_type is not None and self.cp_mask_type not in CP_MASK_TYPES:
            raise ConfigError(f"{where}.cp_mask_type", self.cp_mask_type, CP_MASK_ALLOWED)
        if self.attn_kernel not in ATTN_KERNELS:
            raise ConfigError(f"{where}.attn_kernel", self.attn_kernel, ATTN_KERNEL_ALLOWED)

    @property
    def enabled(self) -> bool:
        if self.disabled:
            return False
        return (self.fused or self.parallel_num > 1 or self.parallel_num == AUTO
                or any(chunks != 1 for _, chunks in self.customized_coc))

    @property
    def cp_algorithm(self) -> str | None:
        """The context-parallel algorithm for the local attention: COC_CP_ALGO, else "megatron"
        (each layer's cp_comm_type) whenever CoC is on, else None (attention left to Megatron)."""
        if self.disabled:
            return None
        return self.cp_algo if self.cp_algo is not None else "megatron" if self.enabled else None

    @property
    def armed(self) -> bool:
        """Does coc-inject patch anything: the linears (enabled) or the attention (cp_algorithm, flash_attn)?"""
        return self.enabled or self.attention_armed

    @property
    def attention_armed(self) -> bool:
        """Is Megatron's local attention patched: context parallelism, or the fused kernel at CP = 1?"""
        return self.cp_algorithm is not None or (self.flash_attn and not self.disabled)

    @property
    def mode(self) -> str:
        """"off" | "chunked" | "fused". Fused wins over the chunk count, as in MindSpeed."""
        if not self.enabled:
            return "off"
        return "fused" if self.fused else "chunked"

    def chunks_for(self, m: int, k: int, n: int) -> int:
        """Chunk count for one matmul shape: its ``customized_coc`` entry, else the global setting.

        -1 means "fused kernel" (this shape's entry, or ``USE_COC_FUSED_KERNEL`` for shapes
        without one: fused wins over ``parallel_num``), 1 means "no CoC for this shape",
        AUTO means "tuned at run time".
        ``disabled`` is not folded in: callers look at ``enabled`` first.
        """
        return self._chunks_by_shape.get((m, k, n), -1 if self.fused else self.parallel_num)

    def _agreed_fields(self) -> dict:
        # The fields every rank must agree on: a mismatch would chunk collectives differently
        # on different ranks and hang. Logging and provenance may differ freely.
        return {
            "parallel_num": self.parallel_num,
            "fused": self.fused,
            "recompute_all_gather": self.recompute_all_gather,
            "enable_coc_in_column_backward": self.enable_coc_in_column_backward,
            "matmul_soc_friendly": self.matmul_soc_friendly,
            "customized_coc": [[list(shape), chunks] for shape, chunks in self.customized_coc],
            "k_min": self.k_min,
            "k_max": self.k_max,
            # Added later: only when set, so default configurations keep their fingerprint.
            **({"fused_backend": self.fused_backend} if self.fused_backend != "auto" else {}),
            **({"deterministic": True} if self.deterministic else {}),
            **({"tune_candidates": list(self.tune_candidates)}
               if self.tune_candidates != _DEFAULTS.tune_candidates else {}),
            # Only when set: "megatron" is implied by CoC on, which the fields above already agree on.
            **({"cp_algo": self.cp_algo, "cp_window": self.cp_window,
                "cp_ulysses_degree": self.cp_ulysses_degree, "cp_mask_type": self.cp_mask_type}
               if (self.cp_algo, self.cp_window, self.cp_ulysses_degree, self.cp_mask_type) != (None, 1, None, None)
               else {}),
            **({"attn_kernel": self.attn_kernel} if self.attn_kernel != "auto" else {}),
            **({"flash_attn": True} if self.flash_attn else {}),
        }

    def fingerprint(self) -> int:
        """A non-negative int < 2**63, equal across processes and machines for equal settings.

        Fits an int64 tensor, so ranks can all-reduce (min/max) it to detect disagreement.
        """
        import hashlib  # lazy: hashlib loads OpenSSL, which the bootstrap should not pay for
        import json

        canonical = json.dumps(["coc-inject-config-v1", self._agreed_fields()], sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "big") & (2**63 - 1)

    def describe(self) -> dict:
        """Plain JSON-able dict for display: every field, plus the derived ``mode`` and ``enabled``."""
        return {
            "mode": self.mode,
            "enabled": self.enabled,
            "parallel_num": "auto" if self.parallel_num == AUTO else self.parallel_num,
            "fused": self.fused,
            "recompute_all_gather": self.recompute_all_gather,
            "enable_coc_in_column_backward": self.enable_coc_in_column_backward,
            "matmul_soc_friendly": self.matmul_soc_friendly,
            "customized_coc": {_shape_text(shape): "auto" if chunks == AUTO else chunks
                               for shape, chunks in self.customized_coc},
            "k_min": self.k_min,
            "k_max": self.k_max,
            "log_level": self.log_level,
            "disabled": self.disabled,
            "config_file": self.config_file,
            "fused_backend": self.fused_backend,
            "deterministic": self.deterministic,
            "allow_untested_megatron": self.allow_untested_megatron,
            "report": self.report,
            "tune_candidates": list(self.tune_candidates),
            "tune_cache": self.tune_cache,
            "cp_algo": self.cp_algo,
            "cp_algorithm": self.cp_algorithm,
            "cp_window": self.cp_window,
            "cp_ulysses_degree": self.cp_ulysses_degree,
            "cp_mask_type": self.cp_mask_type,
            "attn_kernel": self.attn_kernel,
            "flash_attn": self.flash_attn,
        }


_DEFAULTS = CocConfig()

# Keys of MindSpeed's origin ``coc_cfgs`` dict, as accepted in the COC_CONFIG file.
FILE_REFERENCE = (
    Setting("recompute_all_gather", _shown(_DEFAULTS.recompute_all_gather), "JSON true/false or " + BOOL_ALLOWED,
            "Recompute the all-gathered input in the backward pass instead of keeping it."),
    Setting("enable_coc_in_column_backward", _shown(_DEFAULTS.enable_coc_in_column_backward),
            "JSON true/false or " + BOOL_ALLOWED, "Also pipeline the column-parallel backward pass."),
    Setting("matmul_soc_friendly", _shown(_DEFAULTS.matmul_soc_friendly), "JSON true/false or " + BOOL_ALLOWED,
            "On Ascend NPUs: contiguous forward-matmul operands, k zero-padded to a 512-byte multiple "
            "when k_min <= k <= k_max. No-op on CPU and CUDA."),
    Setting("customized_coc", "{}", CUSTOMIZED_ALLOWED, "Per-shape chunk counts, overriding the global one."),
    Setting("k_min", _shown(_DEFAULTS.k_min), POSITIVE_INT_ALLOWED + ", <= k_max",
            "matmul_soc_friendly pads an unaligned contraction size k only when k_min <= k <= k_max."),
    Setting("k_max", _shown(_DEFAULTS.k_max), POSITIVE_INT_ALLOWED + ", >= k_min",
            "Upper end of that k range (see k_min)."),
    # Accepted so origin config files load unchanged; it only switched on MindSpeed's tensor
    # dumps, which coc-inject does not do, so the value is validated and then ignored.
    Setting("print_tensor_value_open", "false", "JSON true/false or " + BOOL_ALLOWED,
            "Accepted for MindSpeed compatibility; ignored."),
)
_FILE_KEYS = tuple(s.name for s in FILE_REFERENCE)
CONFIG_FILE_ALLOWED = "a path to a readable JSON file holding an object with keys " + ", ".join(_FILE_KEYS)

ENV_REFERENCE = (
    Setting("COC_DISABLE", "false", BOOL_ALLOWED,
            "Master off switch: leaves every layer untouched (other variables are still validated)."),
    Setting("COC_PARALLEL_NUM", _shown(_DEFAULTS.parallel_num), PARALLEL_NUM_ALLOWED,
            "Number of chunks each tensor-parallel matmul is split into, pipelined with its collective."),
    Setting("USE_COC_FUSED_KERNEL", _shown(_DEFAULTS.fused), BOOL_ALLOWED,
            "Use the fused matmul+collective kernel; takes precedence over COC_PARALLEL_NUM."),
    Setting("COC_RECOMPUTE_ALL_GATHER", _shown(_DEFAULTS.recompute_all_gather), BOOL_ALLOWED,
            FILE_REFERENCE[0].meaning),
    Setting("COC_ENABLE_IN_COLUMN_BACKWARD", _shown(_DEFAULTS.enable_coc_in_column_backward), BOOL_ALLOWED,
            FILE_REFERENCE[1].meaning),
    Setting("COC_MATMUL_SOC_FRIENDLY", _shown(_DEFAULTS.matmul_soc_friendly), BOOL_ALLOWED,
            FILE_REFERENCE[2].meaning),
    Setting("COC_CUSTOMIZED", "{}", CUSTOMIZED_ALLOWED,
            FILE_REFERENCE[3].meaning + " Replaces the config file's customized_coc entirely."),
    Setting("COC_CONFIG", "(unset)", CONFIG_FILE_ALLOWED,
            "JSON file in MindSpeed's coc_cfgs format; each environment variable overrides its own key."),
    Setting("COC_LOG_LEVEL", _DEFAULTS.log_level, LOG_LEVEL_ALLOWED, "Verbosity of the [coc-inject] stderr lines."),
    Setting("COC_FUSED_BACKEND", _DEFAULTS.fused_backend, FUSED_BACKEND_ALLOWED,
            "With USE_COC_FUSED_KERNEL: auto = the first fused backend that can run the call (atb, mc2, "
            "symm_mem); atb / mc2 / symm_mem = only that one (Ascend ATB lcoc, torch_npu MC2, CUDA symmetric "
            "memory); chunked = never a fused kernel."),
    Setting("COC_DETERMINISTIC", _shown(_DEFAULTS.deterministic), BOOL_ALLOWED,
            "Ask the fused backends for their deterministic mode (sets LCCL_DETERMINISTIC=1 for ATB and "
            "HCCL_DETERMINISTIC=true for HCCL/MC2 before the first kernel); the chunked pipeline is always "
            "deterministic."),
    Setting("COC_ALLOW_UNTESTED_MEGATRON", _shown(_DEFAULTS.allow_untested_megatron), BOOL_ALLOWED,
            "Patch a megatron-core release outside the tested range, or one whose release cannot be determined, "
            "anyway (one warning says it is untested); without it such a release is left unpatched with one "
            "warning."),
    Setting("COC_REPORT", "(unset)", REPORT_ALLOWED,
            "Each rank writes a JSON report of what CoC did per layer at exit; {rank} in the path is "
            "replaced by the global rank, without it only global rank 0 writes."),
    Setting("COC_TUNE_CANDIDATES", ",".join(map(str, _DEFAULTS.tune_candidates)), TUNE_CANDIDATES_ALLOWED,
            "With COC_PARALLEL_NUM=auto (or an \"auto\" COC_CUSTOMIZED value): the chunk counts tried beside "
            "Megatron's own path (N=1) for each shape; counts above the shape's rows are skipped."),
    Setting("COC_TUNE_CACHE", "`${XDG_CACHE_HOME:-~/.cache}/coc-inject/tune.json`", TUNE_CACHE_ALLOWED,
            "Where auto decisions persist, keyed by shape, dtype, TP and world size, device, backend and "
            "host/device name: a job whose shapes are all cached runs no trials. off = tune every run, keep "
            "nothing."),
    Setting("COC_CP_ALGO", "(unset: megatron when CoC is on, else off)", CP_ALGO_ALLOWED,
            "Context parallelism on Megatron's local DotProductAttention (which refuses CP by itself): the "
            "algorithm over the context-parallel group. Setting it arms coc-inject on its own (the linears "
            "may stay off)."),
    Setting("COC_CP_WINDOW", _shown(_DEFAULTS.cp_window), CP_WINDOW_ALLOWED,
            "MindSpeed's --cp-window-size: with ring (and the ring part of hybrid), w > 1 is Double-Ring."),
    Setting("COC_CP_ULYSSES_DEGREE", "(unset: Megatron's hierarchical_context_parallel_sizes)", CP_ULYSSES_ALLOWED,
            "MindSpeed's --ulysses-degree-in-cp: hybrid's Ulysses group size; the ring runs across the groups."),
    Setting("COC_CP_MASK_TYPE", "(unset: the layer's mask type)", CP_MASK_ALLOWED,
            "MindSpeed's --attention-mask-type for the context-parallel attention."),
    Setting("COC_ATTN_KERNEL", _DEFAULTS.attn_kernel, ATTN_KERNEL_ALLOWED,
            "The block kernel of coc-inject's attention (every context-parallel algorithm, and COC_FLASH_ATTN): "
            "CPU flash, CUDA flash / memory-efficient, Ascend npu_fusion_attention, or the reference."),
    Setting("COC_FLASH_ATTN", _shown(_DEFAULTS.flash_attn), BOOL_ALLOWED,
            "Layers built with CP = 1 run the fused attention kernel too, instead of Megatron's unfused [s x s] "
            "local attention (a call it cannot run exactly, e.g. a padding mask or dropout, goes to Megatron's "
            "path with a reason). Arms coc-inject on its own."),
    # Read by sitecustomize.py only (stdlib, at interpreter start), never by load_config.
    Setting("COC_CACHE_DIR", "`${XDG_CACHE_HOME:-~/.cache}/coc-inject/pycache`",
            "an absolute directory of this user's; a relative value (e.g. `off`) turns the cache off",
            "Where the bootstrap keeps the byte code of `coc_inject/__init__.py` and `bootstrap.py` when their "
            "`__pycache__` cannot be used (PYTHONDONTWRITEBYTECODE, read-only checkout)."),
)
_ALLOWED = {s.name: s.allowed for s in ENV_REFERENCE + FILE_REFERENCE}

# Environment variables that override a key of the config file, and the CocConfig field both set.
_ENV_BOOL_FILE_KEYS = (
    ("COC_RECOMPUTE_ALL_GATHER", "recompute_all_gather"),
    ("COC_ENABLE_IN_COLUMN_BACKWARD", "enable_coc_in_column_backward"),
    ("COC_MATMUL_SOC_FRIENDLY", "matmul_soc_friendly"),
)

NO_FLAGS = {"use_ascend_coc": False, "parallel_num": None, "fused": False}


# --- pure value parsers: each returns a value or raises ConfigError ----------------------


def parse_bool(variable: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ConfigError(variable, text, BOOL_ALLOWED)


def parse_parallel_num(variable: str, text: str) -> int:
    digits = text.strip()
    if digits.lower() == "auto":
        return AUTO
    # isdigit + isascii, not int(): int() also takes "+2", "2_0" and non-ASCII digits.
    if digits.isascii() and digits.isdigit() and int(digits) >= 1:
        return int(digits)
    raise ConfigError(variable, text, PARALLEL_NUM_ALLOWED)


def _reject_duplicate_keys(pairs):
    # json.loads silently keeps the last of two equal keys; a repeated key is a typo to report.
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(ValueError):
    pass


def _loads(text: str):
    """json.loads that also rejects duplicate keys and NaN/Infinity."""

    import json  # lazy: only needed when COC_CUSTOMIZED or COC_CONFIG is set

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    return json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=no_constants)


def parse_customized(variable: str, raw) -> tuple:
    """Turn ``{"[m, k, n]": chunks}`` (JSON text or an already-loaded object) into sorted pairs."""
    loaded = raw
    if isinstance(raw, str):
        try:
            loaded = _loads(raw)
        except _DuplicateKey as dup:
            raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason=f"repeats the key {dup.args[0]!r}") from None
        except ValueError as exc:
            raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason=f"is not valid JSON ({exc})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason="is not a JSON object")
    chunks_by_shape = {}
    for key, raw_chunks in loaded.items():
        chunks = _chunk_count_from_json(raw_chunks)
        shape = _parse_shape_key(key)
        if shape is None:
            raise ConfigError(f"{variable} key", key, SHAPE_KEY_ALLOWED)
        if not _is_valid_chunk_count(chunks):
            reason = "is a boolean, not an integer" if isinstance(raw_chunks, bool) else "is invalid"
            raise ConfigError(f"{variable}[{key!r}]", raw_chunks, SHAPE_COUNT_ALLOWED, reason=reason)
        if shape in chunks_by_shape:
            # "[1,2,3]" and "[1, 2, 3]" are the same shape spelled twice.
            raise ConfigError(f"{variable} key", key, SHAPE_KEY_ALLOWED + ", each shape at most once",
                              reason=f"repeats the shape {_shape_text(shape)}")
        chunks_by_shape[shape] = chunks
    return tuple(sorted(chunks_by_shape.items()))


def _parse_shape_key(key: str):
    try:
        shape = _loads(key)
    except ValueError:
        return None
    if isinstance(shape, list) and len(shape) == 3 and all(_is_int(d) and d >= 1 for d in shape):
        return tuple(shape)
    return None


def parse_report_path(variable: str, text: str) -> str:
    path = text.strip()
    if not path or "\0" in path:
        raise ConfigError(variable, text, REPORT_ALLOWED)
    # Whether the directory is writable is checked when the report is armed: a bad path is a
    # warning then, never a configuration error that stops the job.
    return path


def parse_tune_candidates(variable: str, text: str) -> tuple:
    words = [word.strip() for word in text.split(",")]
    if not all(word.isascii() and word.isdigit() and int(word) >= 2 for word in words) or len(set(words)) != len(words):
        raise ConfigError(variable, text, TUNE_CANDIDATES_ALLOWED)
    return tuple(sorted(int(word) for word in words))


def parse_tune_cache(variable: str, text: str) -> str | None:
    path = text.strip()
    if path.lower() == "off":
        return None
    if not os.path.isabs(path) or "\0" in path:
        raise ConfigError(variable, text, TUNE_CACHE_ALLOWED)
    return path


def default_tune_cache(environ) -> str | None:
    """``${XDG_CACHE_HOME:-~/.cache}/coc-inject/tune.json`` (None when no home is known)."""
    base = environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        home = environ.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".cache") if os.path.isabs(home) else ""
    return os.path.join(base, "coc-inject", "tune.json") if base else None


def _one_of(variable: str, text: str, choices, allowed: str, aliases=None) -> str:
    word = text.strip().lower()
    word = (aliases or {}).get(word, word)
    if word in choices:
        return word
    raise ConfigError(variable, text, allowed)


def _int_at_least(variable: str, text: str, minimum: int, allowed: str) -> int:
    digits = text.strip()
    if digits.isascii() and digits.isdigit() and int(digits) >= minimum:
        return int(digits)
    raise ConfigError(variable, text, allowed)


def parse_cp_algo(variable: str, text: str) -> str:
    return _one_of(variable, text, CP_ALGOS, CP_ALGO_ALLOWED, CP_ALGO_ALIASES)


def parse_cp_window(variable: str, text: str) -> int:
    return _int_at_least(variable, text, 1, CP_WINDOW_ALLOWED)


def parse_cp_ulysses_degree(variable: str, text: str) -> int:
    return _int_at_least(variable, text, 2, CP_ULYSSES_ALLOWED)


def parse_cp_mask_type(variable: str, text: str) -> str:
    return _one_of(variable, text, CP_MASK_TYPES, CP_MASK_ALLOWED)


def parse_attn_kernel(variable: str, text: str) -> str:
    return _one_of(variable, text, ATTN_KERNELS, ATTN_KERNEL_ALLOWED)


def parse_fused_backend(variable: str, text: str) -> str:
    return _one_of(variable, text, FUSED_BACKENDS, FUSED_BACKEND_ALLOWED)


def parse_log_level(variable: str, text: str) -> str:
    return _one_of(variable, text, LOG_LEVELS, LOG_LEVEL_ALLOWED)


# --- the config file -------------------------------------------------------------------


def _read_config_file(path: str, errors: list) -> dict:
    """Validated values of the COC_CONFIG file, keyed by CocConfig field; errors are appended."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            raw = _loads(handle.read())
    except OSError as exc:
        errors.append(ConfigError("COC_CONFIG", path, CONFIG_FILE_ALLOWED,
                                  reason=f"cannot be read ({exc.strerror or exc})"))
        return {}
    except UnicodeDecodeError as exc:
        errors.append(ConfigError("COC_CONFIG", path, CONFIG_FILE_ALLOWED, reason=f"is not UTF-8 text ({exc.reason})"))
        return {}
    except _DuplicateKey as dup:
        errors.append(ConfigError("COC_CONFIG", path, CONFIG_FILE_ALLOWED, reason=f"repeats the key {dup.args[0]!r}"))
        return {}
    except ValueError as exc:
        errors.append(ConfigError("COC_CONFIG", path, CONFIG_FILE_ALLOWED, reason=f"is not valid JSON ({exc})"))
        return {}
    if not isinstance(raw, dict):
        errors.append(ConfigError("COC_CONFIG", path, CONFIG_FILE_ALLOWED,
                                  reason=f"holds a JSON {type(raw).__name__}, not an object"))
        return {}

    values = {}
    for key, value in raw.items():
        where = f"COC_CONFIG={path}: key {key!r}"
        try:
            if key not in _FILE_KEYS:
                raise ConfigError(f"COC_CONFIG={path}", key, "one of the keys " + ", ".join(_FILE_KEYS),
                                  reason="has an unknown key")
            if key == "customized_coc":
                # Only an object here: a string would be a JSON document nested in JSON.
                if not isinstance(value, dict):
                    raise ConfigError(where, value, CUSTOMIZED_ALLOWED, reason="is not a JSON object")
                values[key] = parse_customized(where, value)
            elif key in ("k_min", "k_max"):
                if not (_is_int(value) and value >= 1):
                    raise ConfigError(where, value, POSITIVE_INT_ALLOWED)
                values[key] = value
            else:
                values[key] = _file_bool(where, value)
        except ConfigError as exc:
            errors.append(exc)
    # Checked on the values the config would end up with, so a file k_max below the
    # default k_min is caught too.
    k_min, k_max = values.get("k_min", _DEFAULTS.k_min), values.get("k_max", _DEFAULTS.k_max)
    if k_min > k_max:
        errors.append(ConfigError(f"COC_CONFIG={path}: keys 'k_min', 'k_max'", f"{k_min} > {k_max}", "k_min <= k_max"))
    values.pop("print_tensor_value_open", None)  # validated above, then ignored (see FILE_REFERENCE)
    return values


def _file_bool(where: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
    raise ConfigError(where, value, "JSON true/false or " + BOOL_ALLOWED)


# --- putting it together ---------------------------------------------------------------


def _env_text(environ, name: str) -> str | None:
    """The variable's text, or None when unset; empty or blank counts as unset."""
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    return text


def _resolve(environ, argv_flags, cp_flags=None) -> tuple[dict, list]:
    """Every variable parsed in ENV_REFERENCE order; returns (CocConfig kwargs, errors)."""
    errors: list = []
    values: dict = {}

    def parse(name, parser, target):
        text = _env_text(environ, name)
        if text is None:
            return None
        try:
            values[target] = parser(name, text)
        except ConfigError as exc:
            errors.append(exc)
        return text

    parse("COC_DISABLE", parse_bool, "disabled")
    env_parallel_num = parse("COC_PARALLEL_NUM", parse_parallel_num, "parallel_num")
    env_fused = parse("USE_COC_FUSED_KERNEL", parse_bool, "fused")
    env_bools = {target: parse(name, parse_bool, target) for name, target in _ENV_BOOL_FILE_KEYS}
    env_customized = parse("COC_CUSTOMIZED", parse_customized, "customized_coc")

    config_path = _env_text(environ, "COC_CONFIG")
    if config_path is not None:
        config_path = config_path.strip()
        values["config_file"] = config_path
        from_file = _read_config_file(config_path, errors)
        overridden = {target for target, text in env_bools.items() if text is not None}
        if env_customized is not None:
            overridden.add("customized_coc")  # env replaces the file's dict, no merging
        for key, value in from_file.items():
            if key not in overridden:
                values[key] = value

    parse("COC_LOG_LEVEL", parse_log_level, "log_level")
    parse("COC_FUSED_BACKEND", parse_fused_backend, "fused_backend")
    parse("COC_DETERMINISTIC", parse_bool, "deterministic")
    parse("COC_ALLOW_UNTESTED_MEGATRON", parse_bool, "allow_untested_megatron")
    parse("COC_REPORT", parse_report_path, "report")
    parse("COC_TUNE_CANDIDATES", parse_tune_candidates, "tune_candidates")
    if _env_text(environ, "COC_TUNE_CACHE") is None:
        values["tune_cache"] = default_tune_cache(environ)
    parse("COC_TUNE_CACHE", parse_tune_cache, "tune_cache")

    env_cp = {target: parse(name, parser, target) for name, parser, target in _CP_VARIABLES}
    parse("COC_FLASH_ATTN", parse_bool, "flash_attn")
    parse("COC_ATTN_KERNEL", parse_attn_kernel, "attn_kernel")

    _merge_flags(argv_flags, env_parallel_num, env_fused, values, errors)
    _merge_cp_flags(cp_flags or {}, env_cp, values, errors)
    if "attn_kernel" in values and not values.get("disabled"):  # after the flags: they may switch attention on
        _attention_kernel_needs_attention(values, errors)
    return values, errors


# (variable, parser, CocConfig field, MindSpeed flag) of the context-parallel settings.
_CP_SETTINGS = (
    ("COC_CP_ALGO", parse_cp_algo, "cp_algo", "--context-parallel-algo"),
    ("COC_CP_WINDOW", parse_cp_window, "cp_window", "--cp-window-size"),
    ("COC_CP_ULYSSES_DEGREE", parse_cp_ulysses_degree, "cp_ulysses_degree", "--ulysses-degree-in-cp"),
    ("COC_CP_MASK_TYPE", parse_cp_mask_type, "cp_mask_type", "--attention-mask-type"),
)
_CP_VARIABLES = tuple(setting[:3] for setting in _CP_SETTINGS)
# Accepted and removed: coc-inject's ring always overlaps its transfers with compute.
CP_OVERLAP_FLAG = "--use-cp-send-recv-overlap"


def _merge_cp_flags(cp_flags, env_cp, values, errors) -> None:
    """MindSpeed's context-parallel flags where the variable is unset; a disagreement is an error.
    Then: a CP refinement without any CP algorithm would do nothing, which is an error too."""
    for variable, _, target, flag in _CP_SETTINGS:
        if target not in cp_flags:
            continue
        if env_cp[target] is None:
            values[target] = cp_flags[target]
        elif target in values and values[target] != cp_flags[target]:
            errors.append(ConfigError(
                f"{flag} / {variable}", f"{cp_flags[target]} / {env_cp[target].strip()}",
                "the same value in both places, or only one of them",
                message=(f"{flag} {cp_flags[target]} disagrees with {variable}={env_cp[target].strip()}: "
                         "set only one of them, or the same value in both")))
    if values.get("cp_algo") is not None or values.get("disabled") or _coc_on(values):
        return
    for variable, _, target, flag in _CP_SETTINGS[1:]:
        if target in values:
            given = flag if target in cp_flags else variable
            errors.append(ConfigError(given, values[target], "COC_CP_ALGO (or --context-parallel-algo) set too, "
                                      "or CoC on (then the algorithm follows Megatron's cp_comm_type)",
                                      reason="is given but context parallelism is not switched on"))


def _coc_on(values) -> bool:
    """Are the linears' CoC on in these resolved values (CocConfig.enabled, before the config exists)?"""
    return bool(values.get("fused") or values.get("parallel_num", 1) != 1 or any(
        chunks != 1 for _, chunks in values.get("customized_coc", ())))


def _attention_kernel_needs_attention(values, errors) -> None:
    """COC_ATTN_KERNEL without any attention of coc-inject's would do nothing: an error."""
    if values.get("cp_algo") is None and not values.get("flash_attn") and not _coc_on(values):
        errors.append(ConfigError("COC_ATTN_KERNEL", values["attn_kernel"],
                                  "COC_CP_ALGO or COC_FLASH_ATTN=1 set too (or CoC on: then the context-parallel "
                                  "algorithm follows Megatron's cp_comm_type)",
                                  reason="is given but no attention of coc-inject's is switched on"))


def extract_cp_flags(argv: list) -> tuple:
    """Take MindSpeed's context-parallel flags out of ``argv``: (given flags by CocConfig field, the rest).

    ``--context-parallel-algo``, ``--cp-window-size``, ``--ulysses-degree-in-cp`` and
    ``--attention-mask-type`` take a value (``--flag V`` or ``--flag=V``); ``--use-cp-send-recv-overlap``
    is accepted and dropped. Everything after a bare ``--`` is left alone.
    """
    by_flag = {flag: (parser, target) for _, parser, target, flag in _CP_SETTINGS}
    flags: dict = {}
    rest: list = []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            rest.extend(argv[index - 1:])
            break
        name, has_value, text = token.partition("=") if isinstance(token, str) else (token, "", "")
        if name == CP_OVERLAP_FLAG and not has_value:
            continue
        if name not in by_flag:
            rest.append(token)
            continue
        parser, target = by_flag[name]
        if not has_value:
            if index >= len(argv):
                raise ConfigError(name, None, _ALLOWED[_variable_of(target)],
                                  message=f"{name} is missing its value: expected {_ALLOWED[_variable_of(target)]}")
            text = argv[index]
            index += 1
        value = parser(name, text)
        if target in flags and flags[target] != value:
            raise ConfigError(name, text, f"one value (it was already given as {flags[target]})", reason="is given twice")
        flags[target] = value
    return flags, rest


def _variable_of(target: str) -> str:
    return next(variable for variable, _, field_name, _ in _CP_SETTINGS if field_name == target)


def _merge_flags(argv_flags, env_parallel_num, env_fused, values, errors) -> None:
    """Apply MindSpeed's flags where the matching variable is unset; disagreeing with it is an error."""
    if not argv_flags:
        return
    flags = {**NO_FLAGS, **argv_flags}
    flag_num, flag_fused = flags["parallel_num"], bool(flags["fused"])
    if not flags["use_ascend_coc"]:
        if flag_num is not None:
            errors.append(ConfigError("--coc-parallel-num", flag_num, FLAG_NEEDS_USE_ASCEND_COC,
                                      reason="is given without --use-ascend-coc"))
        if flag_fused:
            errors.append(ConfigError("--coc-fused-kernel", True, FLAG_NEEDS_USE_ASCEND_COC,
                                      reason="is given without --use-ascend-coc"))
        return

    if flag_num is not None:
        if not (_is_int(flag_num) and flag_num >= 1):
            errors.append(ConfigError("--coc-parallel-num", flag_num, PARALLEL_NUM_ALLOWED))
        elif env_parallel_num is None:
            values["parallel_num"] = flag_num
        elif "parallel_num" in values and values["parallel_num"] != flag_num:
            errors.append(ConfigError(
                "--coc-parallel-num / COC_PARALLEL_NUM", f"{flag_num} / {env_parallel_num.strip()}",
                "the same value in both places, or only one of them",
                message=(f"--coc-parallel-num {flag_num} disagrees with COC_PARALLEL_NUM={env_parallel_num.strip()}: "
                         "set only one of them, or the same value in both"),
            ))
    if flag_fused:
        if env_fused is None:
            values["fused"] = True
        elif values.get("fused") is False:
            errors.append(ConfigError(
                "--coc-fused-kernel / USE_COC_FUSED_KERNEL", f"true / {env_fused.strip()}",
                "the same setting in both places, or only one of them",
                message=(f"--coc-fused-kernel disagrees with USE_COC_FUSED_KERNEL={env_fused.strip()}: "
                         "drop the flag, or unset the variable"),
            ))


def validate_all(environ=None, argv_flags: dict | None = None, cp_flags: dict | None = None) -> list:
    """Every problem with the settings, in ENV_REFERENCE order (empty when all is well)."""
    _, errors = _resolve(os.environ if environ is None else environ, argv_flags, cp_flags)
    return errors


def load_config(environ=None, argv_flags: dict | None = None, cp_flags: dict | None = None) -> CocConfig:
    """The CocConfig from ``environ`` (default ``os.environ``) and optional MindSpeed flags
    (``argv_flags``: extract_mindspeed_flags; ``cp_flags``: extract_cp_flags).

    Raises the first :class:`ConfigError`; use :func:`validate_all` to see all of them.
    """
    values, errors = _resolve(os.environ if environ is None else environ, argv_flags, cp_flags)
    if errors:
        raise errors[0]
    return CocConfig(**values)


def unknown_variables(environ=None) -> list:
    """Set ``COC_*`` / ``USE_COC_*`` names that are not ours, e.g. typos like COC_PARALLEL_NUMS.

    Not an error (someone else may own the name); meant for a warning or the CLI status.
    """
    environ = os.environ if environ is None else environ
    known = {s.name for s in ENV_REFERENCE}
    return sorted(n for n in environ if n.startswith(("COC_", "USE_COC_")) and n not in known)


# --- MindSpeed command-line drop-in ----------------------------------------------------


def extract_mindspeed_flags(argv: list) -> tuple:
    """Take MindSpeed's CoC flags out of ``argv``: returns (flags, argv without them).

    Recognises ``--use-ascend-coc``, ``--coc-parallel-num N`` / ``--coc-parallel-num=N``
    and ``--coc-fused-kernel``; every other token, and everything after a bare ``--``, is
    left exactly as it was. Removing them lets plain Megatron's argparse run unchanged.
    """
    flags = dict(NO_FLAGS)
    rest: list = []
    num_given = False
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            rest.append(token)
            rest.extend(argv[index:])
            break
        if token == "--use-ascend-coc":
            flags["use_ascend_coc"] = True
        elif token == "--coc-fused-kernel":
            flags["fused"] = True
        elif token == "--coc-parallel-num" or token.startswith("--coc-parallel-num="):
            if token == "--coc-parallel-num":
                if index >= len(argv):
                    raise ConfigError("--coc-parallel-num", None, PARALLEL_NUM_ALLOWED,
                                      message=f"--coc-parallel-num is missing its value: expected {PARALLEL_NUM_ALLOWED}")
                text = argv[index]
                index += 1
            else:
                text = token.partition("=")[2]
            number = parse_parallel_num("--coc-parallel-num", text)
            if num_given and number != flags["parallel_num"]:
                # argparse would silently keep the last one; two different counts is a mistake.
                raise ConfigError("--coc-parallel-num", text, f"one value (it was already given as {flags['parallel_num']})",
                                  reason="is given twice")
            flags["parallel_num"], num_given = number, True
        else:
            rest.append(token)
    if not flags["use_ascend_coc"]:
        if flags["parallel_num"] is not None:
            raise ConfigError("--coc-parallel-num", flags["parallel_num"], FLAG_NEEDS_USE_ASCEND_COC,
                              reason="is given without --use-ascend-coc")
        if flags["fused"]:
            raise ConfigError("--coc-fused-kernel", True, FLAG_NEEDS_USE_ASCEND_COC,
                              reason="is given without --use-ascend-coc")
    return flags, rest
