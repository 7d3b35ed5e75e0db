"""install() / uninstall() of the CoC forwards on Megatron's tensor-parallel layers.

The linears' wing of the job's installation (coc_inject.job): its patches, coverage and tuner
live there, shared with the attention's wing. The replacement forwards are plain functions
(closures), not wrapt proxies: torch.compile (dynamo) traces a plain function, but silently
traces the *original* code behind a wrapt FunctionWrapper, which would turn CoC off under
compile without a word.
"""

from __future__ import annotations

import functools
import logging

from coc_inject import __version__, job, log
from coc_inject.pipeline.layout import effective_chunks
from coc_inject.routes import Chunked, Fused, MegatronPath

LAYERS_MODULE = "megatron.core.tensor_parallel.layers"
PATCHED = ("ColumnParallelLinear", "RowParallelLinear")


class Linears:
    """The linears' wing in one installation: its router, its adapters and what they counted."""

    def __init__(self, config, installation):
        from coc_inject.linear_adapters import ADAPTERS
        from coc_inject.linear_router import LinearRouter

        self.config = config
        self.router = LinearRouter(config, installation)
        self.adapters = {name: adapter(config) for name, adapter in ADAPTERS.items()}
        self.calls = 0  # calls CoC ran (status / tests); Megatron's path is not counted here
        self.coverage = installation.armed_coverage()

    def count(self, call, route, shape_of) -> None:
        """Count a call CoC ran; a chunked one by the chunks its rows really split into."""
        self.calls += 1
        if self.coverage is not None:
            if isinstance(route, Chunked) and call.rows < route.chunks:
                route = Chunked(effective_chunks(call.rows, route.chunks))
            self.coverage.count(call.layer, route, call.megatron_input, shape_of)

    def megatron_path(self, layer, path, input_, shape_of) -> None:
        """Say once why a call takes Megatron's path, and count it."""
        level = logging.DEBUG if path.expected else logging.INFO
        name = type(layer).__name__
        log.once((name, path.reason), level, f"{name}: Megatron's own forward is used: {path.reason}")
        if self.coverage is not None:
            self.coverage.count(layer, path, input_, shape_of)


def _wrap(original, linears: Linears, adapter):
    """The forward put on a linear class: guard, plan, run CoC's path or Megatron's, count."""
    shape_of = adapter.shape

    @functools.wraps(original)
    def forward(self, input_, *args, **kwargs):
        path = adapter.guard(self, input_, args, kwargs)
        if path is None:
            call = adapter.call(original, self, input_, args, kwargs)
            route = linears.router.plan(call)
            if not isinstance(route, MegatronPath):
                output = call.run_coc(call.coc_input, route.kernel if isinstance(route, Fused) else route.chunks)
                linears.count(call, route, shape_of)
                return output
            path = route
        linears.megatron_path(self, path, input_, shape_of)
        return original(self, input_, *args, **kwargs)

    forward.__coc_inject__ = True
    return forward


def is_installed() -> bool:
    return engine() is not None


def engine():
    """The active :class:`Linears`, or None."""
    installation = job.current()
    return installation.engine if installation is not None else None


def install(config=None, layers_module=None) -> bool:
    """Patch the layers for ``config`` (default: from the environment). Idempotent.

    Returns True when the layers are patched afterwards. A second call with another config
    re-installs (the forwards close over one engine).
    """
    from coc_inject.config import load_config

    config = config if config is not None else load_config()
    if not config.enabled:
        uninstall()
        return False
    if layers_module is None:
        import importlib

        layers_module = importlib.import_module(LAYERS_MODULE)
    installation = job.installation(config)
    installation.engine = linears = Linears(config, installation)
    for name in PATCHED:
        cls = getattr(layers_module, name)
        forward = _wrap(installation.patches.original(cls, "forward"), linears, linears.adapters[name])
        installation.patches.patch(cls, "forward", forward)
        installation.patched_forwards[cls] = forward
    installation.armed_coverage()
    return True


def uninstall() -> None:
    """Restore Megatron's original forwards (and everything else the job installed). Safe to call
    when nothing is installed."""
    job.uninstall()


def banner(config, version: str | None) -> str:
    from coc_inject.config import AUTO

    chunks = "fused" if config.fused else "N=auto" if config.parallel_num == AUTO else f"N={config.parallel_num}"
    return (f"CoC installed: rank {log.global_rank()}/{log.world_size()}, mode {config.mode}, {chunks}, megatron-core "
            f"{version or 'of unknown version'}, coc-inject {__version__}, patched "
            + ", ".join(f"{name}.forward" for name in PATCHED))


def on_layers_imported(module) -> None:
    """Post-import hook on ``megatron.core.tensor_parallel.layers`` (registered by bootstrap).

    A configuration error is raised from here on purpose: it makes the Megatron import fail,
    so a training process stops before its first step with the message and a non-zero exit.
    """
    config = job.config()
    if not config.enabled:
        log.logger.debug("CoC is off (%s); Megatron layers left unpatched", config.describe())
        return
    megatron = job.megatron_patchable(config)  # its warning is said once, also when the attention hook decides
    if megatron is None:
        return
    install(config, module)
    # Global rank 0 says it at info level; with COC_LOG_LEVEL=debug every rank does.
    log.logger.log(logging.INFO if log.global_rank() == 0 else logging.DEBUG, banner(config, megatron.version))
