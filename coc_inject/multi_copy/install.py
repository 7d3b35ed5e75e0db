"""install() of multi-copy parallel, and its post-import hook (registered by bootstrap) on
``megatron.core.transformer.transformer_block``; the multi-copy wing of the job's installation
(coc_inject.job: its patches, coverage and tuner are shared with the other wings). Undone by
``job.uninstall()``.

* ``TransformerBlock.forward``: forward.wrap (a call as copies, or Megatron's with the reason).
* Megatron's row-parallel reduce-scatter mapping: marks a cut point inside copies (cuts.py).
* Megatron's global memory buffer: a name per copy, forward and backward (forward.py).
* Megatron's ``tensor_parallel.checkpoint`` (full recompute): inside a copies' forward, the chunk
  recomputed as copies in the backward, in bands (recompute.py).
* Megatron's MoE router (0.16+): its routing losses formed per copy, summing to the batch's (moe.py).
* ``TransformerBlock.__init__``: a block built after another patcher replaced the block's forward
  (MindSpeed's patch manager runs after this hook) finds a forward the copies read as Megatron's
  (:data:`READ_BLOCK_FORWARDS`) wrapped in its turn; any other replacement runs alone, named.

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

from coc_inject import job, log, mindspeed
from coc_inject.config import AUTO
from coc_inject.multi_copy import autograd_check, cuts, forward, moe, recompute

# Block forwards another patcher puts in Megatron's place that the copies run as they run Megatron's: the
# same loop over ``self.layers`` with the same arguments, called once per copy with the copy's arguments.
# (module that defined it, qualified name) -> what it is and where it was read.
READ_BLOCK_FORWARDS = {
    ("mindspeed.te.pytorch.module.checkpoint", "transformer_block_forward"):
        "MindSpeed's block forward (TransformerEngineBasicFeature, every job from 26.0; "
        "mindspeed/te/pytorch/module/checkpoint.py, one blob in 26.0.0 / 26.1.0 core_r0.12.1: megatron-core "
        "0.12.1's block forward with per-layer FP8 contexts, FP8 refused by the copies' allow-list)",
}


def read_as_megatrons(block_forward) -> str | None:
    """What ``block_forward`` is when the copies read it as Megatron's block forward, else None: by the
    module that defined its code and its name (a wrapper defined elsewhere is not it)."""
    return READ_BLOCK_FORWARDS.get((mindspeed.defined_in(block_forward), getattr(block_forward, "__qualname__", None)))


def install(config, transformer_block_module) -> None:
    """Patch for ``config.multi_copy`` (a count >= 2, or AUTO), counting no calls (tests, bench; the
    import hook counts): into the job's installation for ``config``. Undone by ``job.uninstall()``."""
    _install(job.installation(config), transformer_block_module)


def _install(installation, transformer_block_module) -> None:
    patches = installation.patches
    if _left_to_mindspeed(transformer_block_module):
        return
    module_name, name = cuts.GATHER_MAPPING
    mappings = importlib.import_module(module_name)
    if hasattr(mappings, name):
        patches.patch(mappings, name, cuts.marking_gather_mapping(patches.original(mappings, name)))
    module_name, name = recompute.CHECKPOINT
    tensor_parallel = importlib.import_module(module_name)
    if hasattr(tensor_parallel, name):
        patches.patch(tensor_parallel, name, recompute.checkpoint(patches.original(tensor_parallel, name)))
    from megatron.core.utils import GlobalMemoryBuffer

    patches.patch(GlobalMemoryBuffer, "get_tensor",
                  forward.per_copy_get_tensor(patches.original(GlobalMemoryBuffer, "get_tensor")))
    moe.install(patches)  # the routers' losses formed per copy (inside copies only)
    cls = transformer_block_module.TransformerBlock
    multi_copy = forward.MultiCopy(installation, autograd_check.reason())
    patches.patch(cls, "forward", forward.wrap(patches.original(cls, "forward"), multi_copy))
    patches.patch(cls, "__init__", _reading_later_forwards(patches.original(cls, "__init__"), patches, cls, multi_copy))


def _reading_later_forwards(init, patches, cls, multi_copy):
    """TransformerBlock.__init__, then: was the forward coc-inject put on ``cls`` replaced since (MindSpeed's
    adaptor sets its own after importing the module, i.e. after this hook)? One the copies read is wrapped in
    its turn (said once); any other runs alone, MindSpeed's named beside it (the first step's warnings and
    COC_REPORT name every replacement: Patches.taken_over)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        replaced = next((row for row in patches.taken_over() if row[:2] == (cls, "forward")), None)
        if replaced is None or replaced[3]:  # coc-inject's forward is there, or runs inside what is
            return
        now = replaced[2]
        what = read_as_megatrons(now)
        if what is not None:
            patches.patch_over(cls, "forward", forward.wrap(now, multi_copy))
            log.once(("multi-copy reads", what), logging.INFO if log.global_rank() == 0 else logging.DEBUG,
                     f"multi-copy: TransformerBlock.forward is {what}: the copies run under it")
        elif mindspeed.is_mindspeed(now):
            feature = mindspeed.feature_of(now, mindspeed.MULTI_COPY)
            mindspeed.aside(mindspeed.MULTI_COPY, "TransformerBlock.forward", feature)

    return __init__


def _left_to_mindspeed(transformer_block_module) -> bool:
    """Whether MindSpeed replaced something the copies wrap (their cut point, their recompute, the
    block's forward): then no block runs as copies (a copy's cut or recompute would go unseen), said once."""
    wrapped = (cuts.GATHER_MAPPING, recompute.CHECKPOINT)
    found = [(name, mindspeed.attribute_feature(importlib.import_module(module_name), name, mindspeed.MULTI_COPY))
             for module_name, name in wrapped]
    block_forward = transformer_block_module.TransformerBlock.__dict__.get("forward")
    if read_as_megatrons(block_forward) is None:  # one the copies read is wrapped as Megatron's is
        found.append(("TransformerBlock.forward", mindspeed.attribute_feature(
            transformer_block_module.TransformerBlock, "forward", mindspeed.MULTI_COPY)))
    for name, feature in found:
        if feature is not None:
            mindspeed.aside(mindspeed.MULTI_COPY, name, feature)
    return any(feature is not None for _, feature in found)


def banner(config) -> str:
    if mindspeed.said.get(mindspeed.MULTI_COPY):
        return "multi-copy not installed" + mindspeed.note(mindspeed.MULTI_COPY)
    copies = "auto (copies or not per block shape)" if config.multi_copy == AUTO else f"{config.multi_copy} copies"
    unsupported = autograd_check.reason()  # checked at install: the cached answer
    aside = "" if unsupported is None else f"; every block runs Megatron's: {unsupported}"
    return f"multi-copy installed on TransformerBlock: {copies}{aside} (details: coc-inject status, COC_REPORT)"


on_transformer_block_imported = job.wing_hook(lambda config: config.multi_copy_armed, _install, banner)
