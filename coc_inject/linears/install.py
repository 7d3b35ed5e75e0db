"""install() / uninstall() of the CoC forwards on Megatron's tensor-parallel layers.

The linears' wing of the job's installation (coc_inject.job): its patches, coverage and tuner
live there, shared with the attention's wing. The forwards themselves are :mod:`.forward`'s.
"""

from __future__ import annotations

import logging

from coc_inject import __version__, job, log, mindspeed
from coc_inject.linears.forward import Linears, wrap

LAYERS_MODULE = "megatron.core.tensor_parallel.layers"
PATCHED = ("ColumnParallelLinear", "RowParallelLinear")


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
        feature = mindspeed.class_feature(cls, mindspeed.LINEARS)
        if feature is not None:  # MindSpeed's class in Megatron's place: its forward is MindSpeed's
            mindspeed.aside(mindspeed.LINEARS, name, feature)
            continue
        forward = wrap(installation.patches.original(cls, "forward"), linears, linears.adapters[name])
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
            + ", ".join(f"{name}.forward" for name in PATCHED) + mindspeed.note(mindspeed.LINEARS))


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
