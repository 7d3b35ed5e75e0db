"""install() of multi-copy parallel, and its post-import hook (registered by bootstrap) on
``megatron.core.transformer.transformer_block``; the multi-copy wing of the job's installation
(coc_inject.job: its patches, coverage and tuner are shared with the other wings).

* ``TransformerBlock.forward`` runs a call as copies (block.py) or, with the reason, Megatron's.
* Megatron's row-parallel reduce-scatter mapping: marks a cut point inside copies (cuts.py).
* Megatron's global memory buffer: a name per copy (forward and backward).

Before anything is patched, autograd_check.reason() runs the copies' backward once on a tiny graph:
on a torch whose autograd does not behave as it assumes, every block runs Megatron's forward with
that reason (said once, counted, in the banner and COC_REPORT).

Megatron's DDP needs nothing: the copies' backward runs each parameter's AccumulateGrad once per
micro-batch, with every copy's gradient summed (segments.py).

``torch.distributed``'s collectives are not patched here: the copies wrap them only while they run
(collectives.INTERCEPTION).
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref

from coc_inject import job, log
from coc_inject.config import AUTO
from coc_inject.multi_copy import auto, autograd_check, block as copies_block, cuts, scheduler
from coc_inject.routes import CopiesRoute

AUTO_STEPPED_ASIDE = "auto: no copies were faster for this shape"


def install(config, transformer_block_module) -> None:
    """Patch for ``config.multi_copy`` (a count >= 2, or AUTO), counting no calls (tests, bench; the
    import hook counts): into the job's installation for ``config``. Undone by ``job.uninstall()``."""
    _install(job.installation(config), transformer_block_module)


def _install(installation, transformer_block_module) -> None:
    patches = installation.patches
    _patch_gather_mapping(patches)
    _patch_memory_buffer(patches)
    cls = transformer_block_module.TransformerBlock
    patches.patch(cls, "forward", _copies_forward(installation, patches.original(cls, "forward"),
                                                  autograd_check.reason()))


def banner(config) -> str:
    copies = "auto (copies or not per block shape)" if config.multi_copy == AUTO else f"{config.multi_copy} copies"
    unsupported = autograd_check.reason()  # checked at install: the cached answer
    aside = "" if unsupported is None else f"; every block runs Megatron's: {unsupported}"
    return f"multi-copy installed on TransformerBlock: {copies}{aside} (details: coc-inject status, COC_REPORT)"


on_transformer_block_imported = job.wing_hook(lambda config: config.multi_copy_armed, _install, banner)


def _patch_gather_mapping(patches) -> None:
    """Megatron's row-parallel reduce-scatter mapping marks a GATHER cut at its input (cuts.py)."""
    module_name, name = cuts.GATHER_MAPPING
    module = importlib.import_module(module_name)
    if hasattr(module, name):
        patches.patch(module, name, cuts.marking_gather_mapping(patches.original(module, name)))


def _patch_memory_buffer(patches) -> None:
    """Megatron's global memory buffer hands every caller of a name the same memory (the
    sequence-parallel all-gather's output, for one): a copy gets its own, or the other copy would
    overwrite it while a collective writes it or a matmul reads it. In the backward too (the copy of
    the running node), so that no copy's buffer is shared with a collective another copy left in
    flight."""
    from megatron.core import utils

    cls = utils.GlobalMemoryBuffer
    original = patches.original(cls, "get_tensor")

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        copy = scheduler.current_copy()
        return original(self, tensor_shape, dtype, name if copy is None else f"{name}@copy{copy}", *args, **kwargs)

    patches.patch(cls, "get_tensor", get_tensor)


def _copies_forward(installation, original, unsupported: str | None):
    """``unsupported``: why no block may run as copies in this process (autograd_check), or None."""
    setting = installation.config.multi_copy
    copies = auto.AUTO_COPIES[0] if setting == AUTO else setting  # auto: the split is checked for the fewest
    linears_auto = installation.config.tunes_linears  # the config is frozen: read once, not per block call

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        reason = unsupported or copies_block.block_reason(self, copies)
        split = arguments = None
        if reason is None:
            arguments = copies_block.bind(original, self, args, kwargs)
            split = copies_block.plan(self, copies, arguments)
            if isinstance(split, str):
                reason, split = split, None
        choices = [] if split is None else auto.candidates(copies, setting == AUTO, linears_auto, split.batch)
        if len(choices) > 1:
            split = auto.choose(installation.tuner(job.MULTI_COPY), self, original, arguments, split, choices)
            reason = None if split is not None else AUTO_STEPPED_ASIDE
        if split is None:
            _count(installation, self, CopiesRoute(1, len(self.layers), reason))
            return original(self, *args, **kwargs)
        output, in_turn = copies_block.copies_call(self, original, arguments, split)
        _count(installation, self, CopiesRoute(split.copies, len(self.layers), None, in_turn))
        return output

    return forward


def last_route(block) -> CopiesRoute | None:
    """The route of ``block``'s last call (tests, the self-test, a user asking), None before its first;
    kept here, not on Megatron's object."""
    return _last_routes.get(block)


_last_routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> its last call's route


def _count(installation, block, route: CopiesRoute) -> None:
    _last_routes[block] = route
    if route.reason is not None and route.reason != AUTO_STEPPED_ASIDE:
        log.once(("multi-copy", route.reason), logging.WARNING,
                 f"multi-copy: a TransformerBlock runs without copies: {route.reason}")
    if route.backward_in_turn is not None:
        log.once(("multi-copy backward", route.backward_in_turn), logging.WARNING,
                 f"multi-copy: a TransformerBlock's copies run their backward one after the other (no overlap "
                 f"there): {route.backward_in_turn}")
    if installation.coverage is not None:
        installation.coverage.count(block, route, None, lambda layer, _: [])
