"""Interpreter-start half of the injector: is CoC requested, and if so arm a lazy import trigger.

``sitecustomize`` calls :func:`start` in *every* Python process that has the bootstrap on
PYTHONPATH (pip, torchrun's agent, multiprocessing children, small tools...), so this module
is stdlib-only (``os``, ``sys``) and does nothing heavy. When CoC is requested it puts one
tiny finder at the front of ``sys.meta_path`` that reacts only to the top-level name
``megatron``. The first time Megatron is imported, the finder imports wrapt (100+ ms with
wrapt 2.x, so only processes that really import Megatron pay for it) and registers the
post-import hook ``coc_inject.linears.install:on_layers_imported`` on
``megatron.core.tensor_parallel.layers``; the finder then returns ``None`` so the normal
import proceeds untouched. Whether requested or not, a set ``COC_*`` name it does not know
(``COC_PARALLEL_NUMS``) gets one warning on rank 0 naming the closest known one.
"""

import os
import sys

HOOK = "coc_inject.linears.install:on_layers_imported"
TARGET = "megatron.core.tensor_parallel.layers"
# Context parallelism: the local attention, and where the process groups are made.
WING_HOOKS = (
    ("coc_inject.context_parallel.install:on_attention_imported", "megatron.core.transformer.dot_product_attention"),
    ("coc_inject.context_parallel.install:on_parallel_state_imported", "megatron.core.parallel_state"),
    # Multi-copy parallel: the TransformerBlock.
    ("coc_inject.multi_copy.install:on_transformer_block_imported", "megatron.core.transformer.transformer_block"),
    # MoE: the MoE layer (its dispatcher and experts are imported by it).
    ("coc_inject.moe.install:on_moe_layer_imported", "megatron.core.transformer.moe.moe_layer"),
    ("coc_inject.measure.install:on_layers_imported", "megatron.core.tensor_parallel.layers"),
)
TRIGGER = "megatron"

_TRUE_WORDS = frozenset(("1", "true", "yes", "on"))
_FALSE_WORDS = frozenset(("0", "false", "no", "off"))

# The names below are the settings table's (coc_inject.settings.table), copied because importing
# it would cost every Python process start-up time; tests/settings/test_bootstrap.py holds them to the table.
DISABLE = "COC_DISABLE"
# The variables that request coc-inject on their own, each with the values that do not. Any other
# non-blank value does, an invalid one too, so that the config says what is wrong with it.
REQUESTING = {
    "COC_PARALLEL_NUM": ("1",),
    "USE_COC_FUSED_KERNEL": _FALSE_WORDS,
    "COC_CUSTOMIZED": (),
    "COC_CONFIG": (),
    # context parallelism (the config says when a refinement is given without an algorithm)
    "COC_CP_ALGO": (),
    "COC_CP_WINDOW": (),
    "COC_CP_ULYSSES_DEGREE": (),
    "COC_CP_MASK_TYPE": (),
    "COC_ATTN_KERNEL": (),  # the config says when it is given alone
    "COC_FLASH_ATTN": _FALSE_WORDS,
    "COC_MULTI_COPY": ("1",),
    "COC_MOE_OVERLAP": _FALSE_WORDS,
    "COC_MEASURE": _FALSE_WORDS,
    "COC_TRACE": (),
}
# MindSpeed's command-line switches. The config rejects the CoC ones without --use-ascend-coc;
# they count as a request here so that it is the config that says so.
ARGV_FLAGS = ("--use-ascend-coc", "--coc-parallel-num", "--coc-fused-kernel",
              # context parallelism (the config says when one is given without an algorithm)
              "--context-parallel-algo", "--cp-window-size", "--ulysses-degree-in-cp", "--attention-mask-type",
              # MoE
              "--moe-alltoall-overlap-comm")

# Every COC_* / USE_COC_* name coc-inject reads (table.KNOWN_VARIABLES, same test): any other set
# name is most likely a typo that would otherwise leave the job silently unpatched.
KNOWN = (
    "COC_DISABLE", "COC_PARALLEL_NUM", "USE_COC_FUSED_KERNEL", "COC_RECOMPUTE_ALL_GATHER",
    "COC_ENABLE_IN_COLUMN_BACKWARD", "COC_MATMUL_SOC_FRIENDLY", "COC_CUSTOMIZED", "COC_CONFIG", "COC_LOG_LEVEL",
    "COC_FUSED_BACKEND", "COC_DETERMINISTIC", "COC_ALLOW_UNTESTED_MEGATRON", "COC_REPORT", "COC_TUNE_CANDIDATES",
    "COC_TUNE_CACHE", "COC_CP_ALGO", "COC_CP_WINDOW", "COC_CP_ULYSSES_DEGREE", "COC_CP_MASK_TYPE", "COC_ATTN_KERNEL",
    "COC_FLASH_ATTN", "COC_MULTI_COPY", "COC_MOE_OVERLAP", "COC_MEASURE", "COC_MEASURE_EVERY",
    "COC_MEASURE_WARN", "COC_TRACE", "COC_TRACE_STEPS", "COC_CACHE_DIR", "COC_BENCH_DEVICE", "COC_SELFTEST_DEVICE",
)
PREFIXES = ("COC_", "USE_COC_")
# Set once the unknown names were said, so that the processes a launcher starts from this one (torchrun's
# rank 0, dataloader workers) do not say them again. Outside PREFIXES on purpose.
UNKNOWN_SAID = "_COC_INJECT_UNKNOWN_SAID"

_finder = None  # the installed _MegatronTrigger, if any
_unknown_checked = False
_hook_registered = False
hooked_before_megatron = False  # no megatron.core module imported when the hooks were registered
_error = None  # str: why the hook could not be registered (CoC then is NOT active)


def _word(environ, name):
    value = environ.get(name)
    return None if value is None else value.strip()


def requested(environ=None, argv=None) -> bool:
    """Cheap check: does this process ask for CoC? (Validation happens later, in the config.)

    Invalid values count as a request on purpose, so that the config loader, not this
    check, reports them (``COC_PARALLEL_NUM=abc`` must fail loudly, not silently do nothing).
    """
    if environ is None:
        environ = os.environ
    if argv is None:
        argv = getattr(sys, "argv", None) or ()

    disable = _word(environ, DISABLE)
    if disable and disable.lower() in _TRUE_WORDS:
        return False

    # An empty variable counts as unset (``export USE_COC_FUSED_KERNEL=``).
    for name, off in REQUESTING.items():
        word = _word(environ, name)
        if word and word.lower() not in off:
            return True

    for token in argv:
        if isinstance(token, str) and token.startswith("--") and token.partition("=")[0] in ARGV_FLAGS:
            return True
    return False


def unknown_variables(environ) -> list:
    """The set COC_* / USE_COC_* names that coc-inject does not read, sorted."""
    return sorted(name for name in environ if name.startswith(PREFIXES) and name not in KNOWN)


def warn_unknown_variables(environ=None) -> None:
    """One stderr line per unknown COC_* name, naming the closest known one; on rank 0 only (RANK
    unset or 0), once per process tree. Costs one pass over the environment when all is well."""
    global _unknown_checked
    if _unknown_checked:
        return
    _unknown_checked = True
    environ = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if not unknown or (environ.get("RANK") or "0").strip() != "0" or environ.get(UNKNOWN_SAID):
        return
    import difflib  # only when there is something to say: it costs milliseconds

    for name in unknown:
        closest = difflib.get_close_matches(name, KNOWN, n=1)
        hint = f"did you mean {closest[0]}?" if closest else "no coc-inject variable is close to it"
        sys.stderr.write(f"[coc-inject] warning: unknown variable {name} is ignored: {hint} "
                         "(coc-inject reference lists every variable)\n")
    environ[UNKNOWN_SAID] = "1"


class _MegatronTrigger:
    """``sys.meta_path`` finder that fires once, on the first lookup of the ``megatron`` package.

    It never finds anything itself. It stays in ``sys.meta_path`` after firing (removing
    itself while the import system iterates the list would make it skip the next finder);
    afterwards it costs one string compare per import.
    """

    def __init__(self):
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER or self.fired:
            return None
        self.fired = True
        # wrapt inserts its own finder at sys.meta_path[0] here. The import system is
        # iterating that list right now: an insertion before our position only makes it
        # visit us once more (fired -> None), it never skips a finder. wrapt's finder is
        # not consulted for "megatron" itself, which is fine: it only matters for the
        # hooked submodule, whose lookup starts a fresh pass over sys.meta_path.
        _register()
        return None

    def __repr__(self):
        return f"<coc_inject.bootstrap trigger on {TRIGGER!r}, fired={self.fired}>"


def _register():
    """Hand over to wrapt. Missing/broken wrapt is reported once and leaves Megatron unpatched."""
    global _hook_registered, _error
    if _hook_registered:
        return
    try:
        import wrapt

        register = wrapt.register_post_import_hook
    except Exception as exc:  # an internal fault must never break the user's Megatron import
        _error = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(
            "[coc-inject] cannot install the Megatron import hook, CoC is NOT active: "
            + " ".join(_error.split())
            + "\n"
        )
        return
    _hook_registered = True
    global hooked_before_megatron  # the coverage's module tracker is complete only then (coverage/tree.py)
    hooked_before_megatron = TARGET not in sys.modules and not any(
        name == "megatron.core" or name.startswith("megatron.core.") for name in sys.modules)
    # If a hooked module is already imported, wrapt runs its hook right here; a
    # configuration error it raises must propagate (it stops the job on purpose).
    register(HOOK, TARGET)
    for hook, target in WING_HOOKS:
        register(hook, target)


def start():
    """Arm the injector if CoC is requested. Idempotent; cheap when it is not requested."""
    global _finder
    try:
        warn_unknown_variables()
    except Exception:  # a warning must never keep CoC from arming (e.g. no stderr)
        pass
    if _finder is not None or _hook_registered:
        return
    if not requested(os.environ, getattr(sys, "argv", None) or ()):
        return
    if TRIGGER in sys.modules:
        # Megatron is already imported (start() called late, e.g. by hand): hook now.
        # wrapt fires the hook at once if the layers module is already imported too.
        _register()
        return
    _finder = _MegatronTrigger()
    sys.meta_path.insert(0, _finder)


def stop():
    """Remove the trigger (for tests). A hook already handed to wrapt stays registered there."""
    global _finder
    finder, _finder = _finder, None
    if finder is not None:
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass


def state() -> dict:
    """What the bootstrap did in this process (for ``coc-inject status`` and tests)."""
    return {
        "trigger_installed": _finder is not None and _finder in sys.meta_path,
        "trigger_fired": bool(_finder is not None and _finder.fired),
        "hook_registered": _hook_registered,
        "error": _error,
    }


def bootstrap_dir() -> str | None:
    """The directory to put on PYTHONPATH: ``coc_inject/_site`` when installed from a wheel,
    ``<checkout>/sitecustomize`` in a source checkout or editable install."""
    package = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(package, "_site"), os.path.join(os.path.dirname(package), "sitecustomize")):
        if os.path.isfile(os.path.join(candidate, "sitecustomize.py")):
            return candidate
    return None
