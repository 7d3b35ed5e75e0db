"""install() / uninstall() of the CoC forwards on Megatron's tensor-parallel layers.

The replacement forwards are plain functions (closures), not wrapt proxies: torch.compile
(dynamo) traces a plain function, but silently traces the *original* code behind a wrapt
FunctionWrapper, which would turn CoC off under compile without a word.
"""

from __future__ import annotations

import functools
import logging
import os

from coc_inject import __version__, log, megatron_version

LAYERS_MODULE = "megatron.core.tensor_parallel.layers"
PATCHED = ("ColumnParallelLinear", "RowParallelLinear")

_originals: dict = {}  # class -> original forward
_engine = None
_standalone_coverage = None  # the accounting of a job with only context parallelism on


def _wrap(original, route):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return route(original, self, *args, **kwargs)

    forward.__coc_inject__ = True
    return forward


def is_installed() -> bool:
    return bool(_originals)


def engine():
    """The active :class:`~coc_inject.megatron_forward.CocEngine`, or None."""
    return _engine


def install(config=None, layers_module=None) -> bool:
    """Patch the layers for ``config`` (default: from the environment). Idempotent.

    Returns True when the layers are patched afterwards. A second call with another config
    re-installs (the forwards close over one engine).
    """
    global _engine
    from coc_inject.config import load_config
    from coc_inject.coverage import Coverage
    from coc_inject.megatron_forward import CocEngine

    config = config if config is not None else load_config()
    if not config.enabled:
        uninstall()
        return False
    if layers_module is None:
        import importlib

        layers_module = importlib.import_module(LAYERS_MODULE)
    uninstall()
    _engine = CocEngine(config)
    routes = {"ColumnParallelLinear": _engine.column_forward, "RowParallelLinear": _engine.row_forward}
    patched = {}
    for name in PATCHED:
        cls = getattr(layers_module, name)
        original = cls.__dict__["forward"]
        _originals[cls] = original
        cls.forward = patched[cls] = _wrap(original, routes[name])
    _engine.coverage = Coverage(config, patched)
    engine_ = _engine
    _engine.coverage.decisions = lambda: engine_.tuner.decisions if engine_.tuner is not None else {}
    _engine.coverage.arm()
    return True


def standalone_coverage(config):
    """The accounting when the linears are not patched (context parallelism only): armed once."""
    global _standalone_coverage
    from coc_inject.coverage import Coverage

    if _standalone_coverage is None:
        _standalone_coverage = Coverage(config, {})
        _standalone_coverage.arm()
    return _standalone_coverage


def uninstall() -> None:
    """Restore Megatron's original forwards. Safe to call when nothing is installed."""
    global _engine, _standalone_coverage
    if _standalone_coverage is not None:
        _standalone_coverage.disarm()
        _standalone_coverage = None
    from coc_inject.pipeline import agreement

    for cls, original in _originals.items():
        cls.forward = original
    _originals.clear()
    if _engine is not None and _engine.coverage is not None:
        _engine.coverage.disarm()
    _engine = None
    agreement.forget()
    log.reset_once()


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def banner(config, version: str | None) -> str:
    rank, world = _rank_and_world()
    from coc_inject.config import AUTO

    chunks = "fused" if config.fused else "N=auto" if config.parallel_num == AUTO else f"N={config.parallel_num}"
    return (
        f"CoC installed: pid {os.getpid()}, rank {rank}/{world}, mode {config.mode}, {chunks}, "
        f"megatron-core {version or 'of unknown version'}, coc-inject {__version__}, patched "
        + ", ".join(f"{name}.forward" for name in PATCHED)
        + " (which layer calls it runs: the first-step summary)"
    )


def on_layers_imported(module) -> None:
    """Post-import hook on ``megatron.core.tensor_parallel.layers`` (registered by bootstrap).

    A configuration error is raised from here on purpose: it makes the Megatron import fail,
    so a training process stops before its first step with the message and a non-zero exit.
    """
    from coc_inject import job

    config = job.config()
    if not config.enabled:
        log.logger.debug("CoC is off (%s); Megatron layers left unpatched", config.describe())
        return
    megatron = megatron_version.imported()
    decision = megatron_version.support(megatron.version, config.allow_untested_megatron)
    warning = megatron_version.support_warning(megatron, decision)
    if warning is not None:  # said once, also when the attention hook (context parallelism) decides
        log.once(("megatron-support", warning), logging.WARNING, warning)
    if decision not in (megatron_version.TESTED, megatron_version.UNTESTED):
        return
    install(config, module)
    rank, _ = _rank_and_world()
    # Global rank 0 says it at info level; with COC_LOG_LEVEL=debug every rank does.
    log.logger.log(logging.INFO if rank == 0 else logging.DEBUG, banner(config, megatron.version))

