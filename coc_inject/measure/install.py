"""install() of the meter (COC_MEASURE, COC_TRACE), and its post-import hook (registered by
bootstrap) on ``megatron.core.tensor_parallel.layers``: by then Megatron's mappings have bound their
aliases of the collectives, which are wrapped with torch.distributed's. Into the job's installation:
``job.uninstall()`` puts every collective back and removes the meter's hooks.
"""

from __future__ import annotations

import atexit
import logging

from coc_inject import dist_interception, job, log
from coc_inject.measure import metered, records
from coc_inject.measure.exposure import Exposure


def armed(config) -> bool:
    return not config.disabled and (config.measure is not None or config.trace_dir is not None)


def install(config) -> Exposure | None:
    """The meter for ``config`` in the job's installation (tests, bench: the hook does it in a job); None
    where this torch cannot run it (:func:`unsupported`)."""
    return _install(job.installation(config), None)


def unsupported() -> str | None:
    """Why this torch cannot run the meter, or None: it names a backward's layer and phase by the running node."""
    import torch

    if not hasattr(torch._C, "_current_autograd_node"):
        return f"torch {torch.__version__} has no torch._C._current_autograd_node (a backward's collectives unplaced)"
    from torch.nn.modules import module

    for name in ("register_module_forward_pre_hook", "register_module_forward_hook"):
        if not hasattr(module, name):
            return f"torch {torch.__version__} has no torch.nn.modules.module.{name} (collectives' layers unknown)"
    return None


def _install(installation, module=None) -> Exposure | None:
    if getattr(installation, "exposure", None) is not None:
        return installation.exposure
    why = unsupported()
    if why is not None:  # the meter is off; the wings run as they would
        log.once(("COC_MEASURE", "torch"), logging.WARNING, f"coc-inject: not measuring: {why}")
        return None
    exposure = Exposure(installation.config, log.global_rank())
    if installation.config.trace_dir is not None:
        from coc_inject.measure import trace

        problem = trace.unwritable(installation.config.trace_dir)
        if problem is not None:  # said now, once (the same key as a failed write's), and in the report
            log.once(("COC_TRACE", str(installation.config.trace_dir)), logging.WARNING, problem)
            exposure.trace_warnings.append(problem)
    dist_interception.patch_all(lambda name, original: metered.wrapper(exposure, name, original), installation.patches)
    _patch_coalescing(exposure, installation.patches)
    exposure.arm()
    installation.exposure = exposure
    installation.armed_coverage().communication = lambda: (exposure.finish(), exposure.report())[1]
    atexit.register(exposure.finish)

    def undo():
        exposure.disarm()
        atexit.unregister(exposure.finish)
        installation.exposure = None

    installation.undo.append(undo)
    return exposure


# Megatron DDP's gradient buckets go out through torch's coalescing manager (bound at its import).
COALESCING_ALIASES = ("megatron.core.distributed.param_and_grad_buffer",)


def _patch_coalescing(exposure, patches) -> None:
    import sys

    import torch.distributed as dist

    original = getattr(dist, "_coalescing_manager", None)
    if original is None:
        return
    replacement = metered.coalescing(exposure, original)
    patches.patch(dist, "_coalescing_manager", replacement)
    for name in COALESCING_ALIASES:  # imported already; one imported later binds the replacement, which
        module = sys.modules.get(name)  # only calls through once the meter is disarmed
        if module is not None and getattr(module, "_coalescing_manager", None) is original:
            patches.patch(module, "_coalescing_manager", replacement)


def banner(config) -> str:
    why = unsupported()
    if why is not None:
        return f"coc-inject: not measuring exposed communication: {why}"
    what = []
    if config.measure is not None:
        what.append(f"steps {records.step_range(config.measure)}")
    if config.trace_dir is not None:
        what.append(f"trace of steps {records.step_range(config.trace_steps)} into {config.trace_dir}")
    return "coc-inject: measuring exposed communication per wing (" + "; ".join(what) + ")"


on_layers_imported = job.wing_hook(armed, _install, banner)
