"""The settings table: one row per ``COC_*`` setting (and per ``COC_CONFIG``-only key).

Everything else about a setting is derived from its row: the CocConfig field and its check,
where its value comes from (environment > COC_CONFIG file > MindSpeed flag > default), the
reference tables (``coc-inject reference``, the README), ``describe``, the cross-rank fingerprint,
the unknown-variable warning and the MindSpeed flag scanner. The bootstrap keeps its own stdlib
copy of the names that arm it and of every known name (importing this costs start-up time); a test
holds it to the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coc_inject.settings import parsers
from coc_inject.settings.kinds import (AtLeast, ChunkCandidates, ChunkCount, Choice, Kind, OffOnAuto, Percent, ShapeCounts,
                                       StepRange, Switch)
from coc_inject.settings.rules import ATTENTION, CONTEXT_PARALLELISM, MEASURING, TRACING

# ``agreed``: every rank must hold the same value (a mismatch would chunk collectives differently
# and hang), checked by the config's fingerprint. ALWAYS: in every fingerprint; WHEN_SET: only when
# it differs from its default, so configurations that leave it alone keep their fingerprint; any
# other text names a group whose rows enter together when any of them differs from its default.
ALWAYS = "always"
WHEN_SET = "when set"
# ``arms``: setting the variable requests coc-inject at interpreter start. ANY_VALUE: any non-blank
# value (an invalid or useless one too, so that the config says what is wrong with it);
# UNLESS_OFF: any value but the kind's off words.
ANY_VALUE = "any value"
UNLESS_OFF = "unless off"


@dataclass(frozen=True)
class Setting:
    """One row: a setting, where it is read from, what it accepts and what it does."""

    variable: str | None  # the environment variable; None: a COC_CONFIG key only
    field: str | None  # the CocConfig field; None: not part of the config (validated, or read elsewhere)
    kind: Kind | None  # reads and checks the values; None: read elsewhere (sitecustomize)
    default: object
    meaning: str
    allowed: str | None = None  # the reference's "allowed" text; None: the kind's
    default_text: str | None = None  # the reference's default; None: the kind's spelling of ``default``
    file_key: str | None = None  # its key in the COC_CONFIG file (MindSpeed's coc_cfgs)
    flag: str | None = None  # MindSpeed's command-line flag
    flag_needs_use_ascend_coc: bool = False  # MindSpeed honours the flag only with --use-ascend-coc
    agreed: str | None = None  # ALWAYS, WHEN_SET or a group; None: may differ between ranks
    arms: str | None = None  # ANY_VALUE or UNLESS_OFF; None: does not request coc-inject by itself
    needs: str | None = None  # a switch (rules.SWITCHED_ON) without which this setting would do nothing
    compared: bool = True  # part of CocConfig's equality and hash
    environ_default: Callable | None = None  # the default when unset, read from other variables
    variable_note: str = ""  # said after the meaning in the variable table only
    exports: tuple = ()  # (variable, value) pairs set in the process's environment when the setting is on

    @property
    def env_allowed(self) -> str:
        return self.allowed or self.kind.allowed

    @property
    def file_allowed(self) -> str:
        return self.allowed or self.kind.json_allowed

    @property
    def shown_default(self) -> str:
        return self.default_text if self.default_text is not None else self.kind.text(self.default)


LOG_LEVELS = ("debug", "info", "warning", "error")
# Kept in step with coc_inject.linears.fused.registry.CHOICES (a test checks); this module stays torch-free.
FUSED_BACKENDS = ("auto", "chunked", "atb", "mc2", "symm_mem")
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

MULTI_COPY_ALLOWED = ("1 (off), an integer n >= 2 (copies; they must divide the micro-batch) or auto (copies or not, "
                      "tried per block shape at run time)")

MOE_OVERLAP_ALLOWED = ("0 (off), 1 (pieces) or auto (pieces or Megatron's dispatcher, tried per MoE layer shape at run "
                       "time); also true/false, on/off, yes/no (any case)")

MEASURE_ALLOWED = ("0 (off), 1 (every step), or a step range A-B or A- (from step A on); steps count from 1, each "
                   "ending at an optimizer step; also true/false, on/off, yes/no (any case)")
TRACE_STEPS_ALLOWED = "a step A or a step range A-B (steps count from 1, each ending at an optimizer step)"

SWITCH = Switch()
POSITIVE_INT = AtLeast(1, parsers.POSITIVE_INT_ALLOWED)
# COC_CONFIG's allowed text lists the file keys, so it is filled in below, once the rows exist.
CONFIG_FILE = Kind("")

SETTINGS = (
    Setting("COC_DISABLE", "disabled", SWITCH, False,
            "Master off switch: leaves every layer untouched (other variables are still validated)."),
    Setting("COC_PARALLEL_NUM", "parallel_num", ChunkCount(), 1,
            "Number of chunks each tensor-parallel matmul is split into, pipelined with its collective.",
            flag="--coc-parallel-num", flag_needs_use_ascend_coc=True, agreed=ALWAYS, arms=UNLESS_OFF),
    Setting("USE_COC_FUSED_KERNEL", "fused", SWITCH, False,
            "Use the fused matmul+collective kernel; takes precedence over COC_PARALLEL_NUM.",
            flag="--coc-fused-kernel", flag_needs_use_ascend_coc=True, agreed=ALWAYS, arms=UNLESS_OFF),
    Setting("COC_RECOMPUTE_ALL_GATHER", "recompute_all_gather", SWITCH, True,
            "Recompute the all-gathered input in the backward pass instead of keeping it.",
            file_key="recompute_all_gather", agreed=ALWAYS),
    Setting("COC_ENABLE_IN_COLUMN_BACKWARD", "enable_coc_in_column_backward", SWITCH, False,
            "Also pipeline the column-parallel backward pass.",
            file_key="enable_coc_in_column_backward", agreed=ALWAYS),
    Setting("COC_MATMUL_SOC_FRIENDLY", "matmul_soc_friendly", SWITCH, True,
            "On Ascend NPUs: contiguous forward-matmul operands, k zero-padded to a 512-byte multiple "
            "when k_min <= k <= k_max. No-op on CPU and CUDA.",
            file_key="matmul_soc_friendly", agreed=ALWAYS),
    Setting("COC_CUSTOMIZED", "customized_coc", ShapeCounts(), (),
            "Per-shape chunk counts, overriding the global one.", default_text="{}",
            variable_note=" Replaces the config file's customized_coc entirely.",
            file_key="customized_coc", agreed=ALWAYS, arms=ANY_VALUE),
    Setting(None, "k_min", POSITIVE_INT, 1024,
            "matmul_soc_friendly pads an unaligned contraction size k only when k_min <= k <= k_max.",
            allowed=parsers.POSITIVE_INT_ALLOWED + ", <= k_max", file_key="k_min", agreed=ALWAYS),
    Setting(None, "k_max", POSITIVE_INT, 4096, "Upper end of that k range (see k_min).",
            allowed=parsers.POSITIVE_INT_ALLOWED + ", >= k_min", file_key="k_max", agreed=ALWAYS),
    # Accepted so origin config files load unchanged; it only switched on MindSpeed's tensor
    # dumps, which coc-inject does not do, so the value is validated and then ignored.
    Setting(None, None, SWITCH, False, "Accepted for MindSpeed compatibility; ignored.",
            file_key="print_tensor_value_open"),
    Setting("COC_CONFIG", "config_file", CONFIG_FILE, None,
            "JSON file in MindSpeed's coc_cfgs format; each environment variable overrides its own key.",
            default_text="(unset)", arms=ANY_VALUE),
    Setting("COC_LOG_LEVEL", "log_level", Choice(LOG_LEVELS), "info", "Verbosity of the [coc-inject] stderr lines."),
    Setting("COC_FUSED_BACKEND", "fused_backend", Choice(FUSED_BACKENDS), "auto",
            "With USE_COC_FUSED_KERNEL: auto = the first fused backend that can run the call (atb, mc2, "
            "symm_mem); atb / mc2 / symm_mem = only that one (Ascend ATB lcoc, torch_npu MC2, CUDA symmetric "
            "memory); chunked = never a fused kernel.", agreed=WHEN_SET),
    Setting("COC_DETERMINISTIC", "deterministic", SWITCH, False,
            "Ask the fused backends for their deterministic mode (sets LCCL_DETERMINISTIC=1 for ATB and "
            "HCCL_DETERMINISTIC=true for HCCL/MC2 before the first kernel); the chunked pipeline is always "
            "deterministic.", agreed=WHEN_SET,
            # Read when the first communicator is built, so set before any kernel: ATB's LCCL (deterministic
            # tiling of its all-reduce) and HCCL (deterministic reductions; whether that covers the MC2 ops
            # is unconfirmed, docs/dev/fused-backends.md §4).
            exports=(("LCCL_DETERMINISTIC", "1"), ("HCCL_DETERMINISTIC", "true"))),
    Setting("COC_ALLOW_UNTESTED_MEGATRON", "allow_untested_megatron", SWITCH, False,
            "Patch a megatron-core release outside the tested range, or one whose release cannot be determined, "
            "anyway (one warning says it is untested); without it such a release is left unpatched with one "
            "warning."),
    Setting("COC_REPORT", "report", Kind(parsers.REPORT_ALLOWED, parsers.parse_report_path), None,
            "Each rank writes a JSON report of what CoC did per layer at exit; {rank} in the path is "
            "replaced by the global rank, without it only global rank 0 writes.", default_text="(unset)"),
    Setting("COC_TUNE_CANDIDATES", "tune_candidates", ChunkCandidates(), (2, 4, 8),
            "With COC_PARALLEL_NUM=auto (or an \"auto\" COC_CUSTOMIZED value): the chunk counts tried beside "
            "Megatron's own path (N=1) for each shape; counts above the shape's rows are skipped.", agreed=WHEN_SET),
    # Process-local (ranks agree on each decision), so not part of equality either.
    Setting("COC_TUNE_CACHE", "tune_cache", Kind(parsers.TUNE_CACHE_ALLOWED, parsers.parse_tune_cache), None,
            "Where auto decisions persist, keyed by shape, dtype, TP and world size, device, backend and "
            "host/device name: a job whose shapes are all cached runs no trials. off = tune every run, keep "
            "nothing.", default_text="`${XDG_CACHE_HOME:-~/.cache}/coc-inject/tune.json`",
            compared=False, environ_default=parsers.default_tune_cache),
    Setting("COC_CP_ALGO", "cp_algo", Choice(CP_ALGOS, CP_ALGO_ALLOWED, CP_ALGO_ALIASES), None,
            "Context parallelism on Megatron's local DotProductAttention (which refuses CP by itself): the "
            "algorithm over the context-parallel group. Setting it arms coc-inject on its own (the linears "
            "may stay off).", default_text="(unset: megatron when CoC is on, else off)",
            flag="--context-parallel-algo", agreed=CONTEXT_PARALLELISM, arms=ANY_VALUE),
    Setting("COC_CP_WINDOW", "cp_window", AtLeast(1, CP_WINDOW_ALLOWED), 1,
            "MindSpeed's --cp-window-size: with ring (and the ring part of hybrid), w > 1 is Double-Ring.",
            flag="--cp-window-size", agreed=CONTEXT_PARALLELISM, arms=ANY_VALUE, needs=CONTEXT_PARALLELISM),
    Setting("COC_CP_ULYSSES_DEGREE", "cp_ulysses_degree", AtLeast(2, CP_ULYSSES_ALLOWED), None,
            "MindSpeed's --ulysses-degree-in-cp: hybrid's Ulysses group size; the ring runs across the groups.",
            default_text="(unset: Megatron's hierarchical_context_parallel_sizes)",
            flag="--ulysses-degree-in-cp", agreed=CONTEXT_PARALLELISM, arms=ANY_VALUE, needs=CONTEXT_PARALLELISM),
    Setting("COC_CP_MASK_TYPE", "cp_mask_type", Choice(CP_MASK_TYPES, CP_MASK_ALLOWED), None,
            "MindSpeed's --attention-mask-type for the context-parallel attention.",
            default_text="(unset: the layer's mask type)",
            flag="--attention-mask-type", agreed=CONTEXT_PARALLELISM, arms=ANY_VALUE, needs=CONTEXT_PARALLELISM),
    Setting("COC_ATTN_KERNEL", "attn_kernel", Choice(ATTN_KERNELS, ATTN_KERNEL_ALLOWED), "auto",
            "The block kernel of coc-inject's attention (every context-parallel algorithm, and COC_FLASH_ATTN): "
            "CPU flash, CUDA flash / memory-efficient, Ascend npu_fusion_attention, or the reference.",
            agreed=WHEN_SET, arms=ANY_VALUE, needs=ATTENTION),
    Setting("COC_FLASH_ATTN", "flash_attn", SWITCH, False,
            "Layers built with CP = 1 run the fused attention kernel too, instead of Megatron's unfused [s x s] "
            "local attention (a call it cannot run exactly, e.g. a padding mask or dropout, goes to Megatron's "
            "path with a reason). Arms coc-inject on its own.", agreed=WHEN_SET, arms=UNLESS_OFF),
    Setting("COC_MULTI_COPY", "multi_copy", ChunkCount(MULTI_COPY_ALLOWED), 1,
            "Multi-copy parallel (MindSpore's micro_batch_interleave_num): each TransformerBlock call splits its "
            "micro-batch into n copies along the batch and runs them in turns, one computing while another's "
            "tensor-parallel collective is in flight, forward and backward. auto: none, 2 or 4 copies, as the "
            "block's trials find fastest; with COC_PARALLEL_NUM=auto or COC_MOE_OVERLAP=auto the trials also try "
            "the copies with Megatron's linears or dispatcher inside (at a fixed count too), so that every wing on "
            "auto runs the best of them alone and together. Arms coc-inject on its own.",
            agreed=WHEN_SET, arms=UNLESS_OFF),
    Setting("COC_MOE_OVERLAP", "moe_overlap", OffOnAuto(MOE_OVERLAP_ALLOWED), "0",
            "MoE: the expert-parallel all-to-all of Megatron's alltoall token dispatcher cut into pieces (one per "
            "local expert, an expert's rows cut further where a rank has fewer than 8; with grouped experts (GroupedMLP, "
            "TEGroupedMLP), 8 pieces each a chunk of every local expert's rows in one call of their forward) and pipelined against the "
            "local experts' compute, forward and backward; results as Megatron's. auto: pieces or Megatron's "
            "dispatcher, as the layer's trials find fastest. Arms coc-inject on its own.",
            flag="--moe-alltoall-overlap-comm", agreed=WHEN_SET, arms=UNLESS_OFF),
    Setting("COC_MEASURE", "measure", StepRange(MEASURE_ALLOWED, on_means=(1, None)), None,
            "Exposed communication per wing: every collective of the measured steps (coc-inject's and Megatron's "
            "own) timed in flight and where the rank waited for it, summed per wing, per collective and per "
            "layer: in the first-step summary, every COC_MEASURE_EVERY steady steps, at the run's end (its steady "
            "steps: the first measured one and those with auto's trials left out), in COC_REPORT and `coc-inject "
            "report`. Off costs nothing; its cost on: `make bench-accounting`. Arms coc-inject on its own.",
            default_text="0", arms=UNLESS_OFF),
    Setting("COC_MEASURE_EVERY", "measure_every", AtLeast(0, "an integer >= 0 (0: the first step and the end only)"),
            0, "With COC_MEASURE: also a line per wing every K steady steps (the last K steady steps' figures: the "
               "first measured step and steps with auto's trials left out).",
            needs=MEASURING),
    Setting("COC_MEASURE_WARN", "measure_warn", Percent("an integer percent from 0 to 100 (0: never warn)"), 20,
            "With COC_MEASURE: warn when a wing that is on hides less than this share of its communication "
            "(a collective it did not overlap, a link so fast that nothing waited, ...).", needs=MEASURING),
    Setting("COC_TRACE", "trace_dir", Kind(parsers.TRACE_ALLOWED, parsers.parse_trace_dir), None,
            "Each rank writes a Chrome-trace JSON (Perfetto, chrome://tracing) of the COC_TRACE_STEPS steps into "
            "this directory: compute, each collective in flight on its group's track, the waits. Measures those "
            "steps (as COC_MEASURE). Arms coc-inject on its own.", default_text="(unset)", arms=ANY_VALUE),
    Setting("COC_TRACE_STEPS", "trace_steps", StepRange(TRACE_STEPS_ALLOWED), (2, 2),
            "The steps COC_TRACE writes (the first step runs auto's trials, so the second by default).",
            needs=TRACING),
    # Read by sitecustomize.py only (stdlib, at interpreter start), never by the config.
    Setting("COC_CACHE_DIR", None, None, None,
            "Where the bootstrap keeps the byte code of `coc_inject/__init__.py` and `bootstrap.py` when their "
            "`__pycache__` cannot be used (PYTHONDONTWRITEBYTECODE, read-only checkout).",
            allowed="an absolute directory of this user's; a relative value (e.g. `off`) turns the cache off",
            default_text="`${XDG_CACHE_HOME:-~/.cache}/coc-inject/pycache`"),
)

FIELDS = tuple(row for row in SETTINGS if row.field is not None)  # CocConfig's fields, in this order
BY_FIELD = {row.field: row for row in FIELDS}
FILE_KEYS = {row.file_key: row for row in SETTINGS if row.file_key is not None}
FLAGS = tuple(row for row in SETTINGS if row.flag is not None)
VARIABLES = tuple(row.variable for row in SETTINGS if row.variable is not None)
# Read by ``coc-inject bench`` / ``selftest`` under torchrun (which device), not settings of a job.
TOOL_VARIABLES = ("COC_BENCH_DEVICE", "COC_SELFTEST_DEVICE")
# Every COC_* / USE_COC_* name coc-inject reads: any other one is warned about (a typo, most likely).
KNOWN_VARIABLES = VARIABLES + TOOL_VARIABLES
CONFIG_FILE.allowed = "a path to a readable JSON file holding an object with keys " + ", ".join(FILE_KEYS)


def variable_for(field: str) -> str:
    """The environment variable of a CocConfig field, e.g. ``cp_window`` -> ``COC_CP_WINDOW``."""
    return BY_FIELD[field].variable


@dataclass(frozen=True)
class ReferenceRow:
    """One row of a reference table (``coc-inject reference``, the README)."""

    name: str
    default: str
    allowed: str
    meaning: str


ENV_REFERENCE = tuple(ReferenceRow(row.variable, row.shown_default, row.env_allowed, row.meaning + row.variable_note)
                      for row in SETTINGS if row.variable is not None)
# Keys of MindSpeed's origin ``coc_cfgs`` dict, as accepted in the COC_CONFIG file.
FILE_REFERENCE = tuple(ReferenceRow(row.file_key, row.shown_default, row.file_allowed, row.meaning)
                       for row in SETTINGS if row.file_key is not None)
