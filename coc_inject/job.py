"""This process's coc-inject job: its settings and its one installation.

The Megatron import hooks (linears, attention, parallel state) share both. The configuration:
MindSpeed's flags are taken out of ``sys.argv`` once, by the first hook, before Megatron's own
argument parser runs; it is re-read when the ``COC_*`` environment changes (tests, tools that
re-install in one process). The :class:`Installation`: every attribute the hooks patched, the
coverage and the auto tuners, so the linears' and the attention's calls land in one summary and
one report, and :func:`uninstall` undoes all of it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from coc_inject import log, megatron_version, mindspeed, verdicts
from coc_inject.coverage import Coverage, tree
from coc_inject.patches import Patches, describe
from coc_inject.pipeline import agreement

LINEARS, ATTENTION, MULTI_COPY, MOE = "linears", "attention", "multi-copy", "moe"  # the wings, each with its own tuner

_flags = None  # (MindSpeed CoC flags, MindSpeed CP flags) taken out of sys.argv
_loaded = None  # (environment key, CocConfig)


def _environment_key() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("COC_", "USE_COC_"))))


def config():
    """The job's CocConfig; a ConfigError is written to stderr and raised (it stops the import)."""
    global _flags, _loaded
    from coc_inject.config import ConfigError, extract_cp_flags, extract_mindspeed_flags, load_config

    key = _environment_key()
    if _loaded is not None and _loaded[0] == key:
        return _loaded[1]
    try:
        flags, remaining = _flags, None
        if flags is None:
            if importlib.util.find_spec("mindspeed") is not None:  # MindSpeed owns its flags
                flags, remaining = (None, None), list(sys.argv)
            else:
                coc_flags, remaining = extract_mindspeed_flags(list(sys.argv))
                cp_flags, remaining = extract_cp_flags(remaining)
                flags = (coc_flags, cp_flags)
        loaded = load_config(argv_flags=flags[0], cp_flags=flags[1])
    except ConfigError as error:
        sys.stderr.write(f"[coc-inject] configuration error: {error}\n")
        raise
    if remaining is not None:
        sys.argv[:] = remaining
        _flags = flags
    log.configure(loaded.log_level)
    _loaded = (key, loaded)
    return loaded


def forget() -> None:
    """Back to before the first hook (tests)."""
    global _flags, _loaded
    _flags = _loaded = None


def megatron_patchable(config) -> megatron_version.Megatron | None:
    """The imported megatron-core when coc-inject may patch it for ``config``, else None; the
    support warning is said once, whichever hook decides first."""
    megatron = megatron_version.imported()
    decision = megatron_version.support(megatron.version, config.allow_untested_megatron)
    warning = megatron_version.support_warning(megatron, decision)
    if warning is not None:
        log.once(("megatron-support", warning), logging.WARNING, warning)
    return megatron if decision in (megatron_version.TESTED, megatron_version.UNTESTED) else None


def wing_hook(armed, install, banner):
    """A wing's post-import hook: when ``armed(config)`` and Megatron may be patched, ``install(installation,
    module)`` into the job's installation (its coverage armed) and say ``banner(config)`` once (rank 0)."""

    def hook(module) -> None:
        job_config = config()
        if not armed(job_config) or megatron_patchable(job_config) is None:
            return
        job_installation = installation(job_config)
        job_installation.armed_coverage()
        install(job_installation, module)
        log.logger.log(logging.INFO if log.global_rank() == 0 else logging.DEBUG, banner(job_config))

    return hook


class Installation:
    """What the hooks put into this process for one configuration."""

    def __init__(self, config):
        self.config = config
        self.patches = Patches()
        self.engine = None  # the linears' forward.Linears, when they are patched
        self.tuners: dict = {}  # wing -> tuning.Tuner, made at the wing's first auto call
        self.patched_forwards: dict = {}  # linear class -> the forward put there (the coverage checks it)
        self.coverage = None  # made by the first hook that counts calls, armed once
        self.exposure = None  # the meter (coc_inject.measure), with COC_MEASURE or COC_TRACE
        self.undo: list = []  # what else uninstall() calls (the meter's hooks), last first
        self.verdict_owners: dict = {}  # verdicts.remember's: name -> the layers / blocks it cached a verdict on
        self.tracker = tree.start(self.undo)  # the modules built since Megatron's import (or None: the heap's)

    def armed_coverage(self) -> Coverage:
        if self.coverage is None:
            self.coverage = Coverage(self.config, self.patched_forwards)
            self.coverage.decisions = lambda: self.decisions(LINEARS)
            self.coverage.attention_decisions = lambda: self.decisions(ATTENTION)
            self.coverage.copies_decisions = lambda: self.decisions(MULTI_COPY)
            self.coverage.moe_decisions = lambda: self.decisions(MOE)
            self.coverage.taken_over = self.patches.taken_over
            self.coverage.tracker = self.tracker
            self.coverage.arm()
        return self.coverage

    def tuner(self, wing: str):
        tuner = self.tuners.get(wing)
        if tuner is None:
            from coc_inject.tuning.online import Tuner, cache_for  # torch: only once an auto call runs

            tuner = self.tuners[wing] = Tuner(self.config, cache_for(self.config))
        return tuner

    def decisions(self, wing: str) -> dict:
        tuner = self.tuners.get(wing)
        return tuner.decisions if tuner is not None else {}

    def uninstall(self) -> None:
        while self.undo:
            self.undo.pop()()
        for owner, name, now, ours_still_runs in self.patches.restore():
            log.logger.warning(f"uninstall: {describe(owner, name, now)} was set after coc-inject patched it: left "
                               "in place (putting Megatron's original back would take that patch away)"
                               + ("; coc-inject's wrapper inside it stays" if ours_still_runs else ""))
        self.patched_forwards.clear()
        verdicts.drop(self.verdict_owners)  # decided for this installation: a re-install decides afresh
        if self.coverage is not None:
            self.coverage.disarm()


_installation: Installation | None = None


def current() -> Installation | None:
    return _installation


def installation(config) -> Installation:
    """The installation for ``config``: the current one when it was made for this config, else a
    new one (a current one for another config undone first)."""
    global _installation
    if _installation is not None and _installation.config is not config:
        uninstall()
    if _installation is None:
        _installation = Installation(config)
        os.environ.update(config.exported_environment())  # before any communicator or kernel reads them
    return _installation


def uninstall(forget_said: bool = True) -> None:
    """Undo the installation (every patch, the coverage's hooks) and the cross-rank agreements;
    ``forget_said``: also forget which messages were said once, so a re-install reports afresh."""
    global _installation
    if _installation is not None:
        _installation.uninstall()
        _installation = None
    agreement.forget()
    if forget_said:
        log.reset_once()
        mindspeed.said.clear()  # said again by the next installation's wings, not carried into its summary
