"""What multi-copy puts in Megatron's place, and the wing object it closes over.

* ``TransformerBlock.forward`` (:func:`wrap`): the call as copies (block.py), split as
  :meth:`MultiCopy.split` decides, or Megatron's forward with the reason; counted either way.
* ``GlobalMemoryBuffer.get_tensor`` (:func:`per_copy_get_tensor`): a name per copy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref

from coc_inject import job, log, verdicts
from coc_inject.allowlist import check
from coc_inject.config import AUTO
from coc_inject.multi_copy import agreed, auto, autograd_check, block as copies_block, moe as copies_moe, scheduler, splits
from coc_inject.pipeline import agreement
from coc_inject.routes import CopiesRoute

AUTO_STEPPED_ASIDE = "auto: no copies were faster for this shape"
NO_COLLECTIVE = ("auto: no tensor-, context- or expert-parallel collective in this block (TP 1, CP 1, no MoE layer "
                 "with EP or expert TP > 1): nothing for copies to hide, no trial")
SAID_ASIDE = (AUTO_STEPPED_ASIDE, NO_COLLECTIVE)  # on purpose: no warning
VERDICT = "_coc_copies_verdict"  # on the block: verdicts.Verdict of MultiCopy.decide
# What the block's verdict reads of its config besides multi-copy's allow-list rows: the group sizes and
# the recompute settings (splits.block_reason, recompute.reason, no_collective).
BLOCK_READS = ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "recompute_granularity", "recompute_modules",
               "distribute_saved_activations", "calculate_per_token_loss", "moe_z_loss_coeff", "moe_aux_loss_coeff",
               "moe_router_load_balancing_type")


class MultiCopy:
    """The multi-copy wing in one installation: its copy count, the split of a block call and the
    routes counted."""

    def __init__(self, installation, unsupported: str | None):
        """``unsupported``: why no block may run as copies in this process (autograd_check), or None."""
        config = installation.config  # frozen: read once, not per block call
        self.installation = installation
        self.unsupported = unsupported
        self.auto = config.multi_copy == AUTO
        self.copies = auto.AUTO_COPIES[0] if self.auto else config.multi_copy  # auto: the split is checked for the fewest
        self.linears_auto = config.tunes_linears
        self.experts_auto = config.moe_armed and config.moe_overlap == "auto"
        shown = config.agreed_values()["COC_MULTI_COPY"]
        self.agreement = agreement.FirstCall(config, f"multi-copy (COC_MULTI_COPY={shown}) at its first block call")

    def decide(self, block) -> verdicts.Verdict:
        """What the block's construction, config, training mode and groups decide for every call, kept on the
        block keyed by what it read (coc_inject.verdicts): ``(why not or None, the route counted when not,
        whether a MoE layer may run as pieces)``."""
        reason = (self.unsupported or splits.block_reason(block, self.copies) or copies_moe.block_reason(block)
                  or (no_collective(block) if self.auto else None))
        route = None if reason is None else CopiesRoute(1, len(block.layers), reason)
        value = (reason, route, reason is None and self.experts_auto and _has_pieces_layer(block))
        config = block.config
        read = _block_reads(type(config))
        return verdicts.remember(self.installation, block, VERDICT, config, read, block.training, value)

    def split(self, block, original, args, kwargs) -> tuple:
        """``(Split, forward's arguments by name)`` of a block call that runs as copies, else
        ``(why not, None)``: the block and the call (splits.py), then COC_MULTI_COPY=auto's trials (auto.py).
        The first call agrees the settings over the block's groups (agreed.py) before any of them."""
        if self.agreement.pending:
            self.agreement(agreed.groups(block, self.auto or self.linears_auto or self.experts_auto),
                           {"multi-copy can run here": self.unsupported is None})
        reason = self.unsupported or autograd_check.saved_hooks_reason()  # at install / this call: no block read
        if reason is not None:
            return reason, None
        verdict = block.__dict__.get(VERDICT)
        if verdict is None or not verdict.holds(self.installation, block.__dict__.get("config"), block.training):
            verdict = self.decide(block)
        reason, _, experts_auto = verdict.value
        if reason is not None:
            return reason, None
        arguments = splits.bind(original, block, args, kwargs)
        split = splits.plan(block, self.copies, arguments)
        if isinstance(split, str):
            return split, None
        reason = copies_moe.call_reason(block, arguments)
        if reason is not None:
            return reason, None
        choices = auto.candidates(self.copies, self.auto, self.linears_auto, split.rows, split.most, experts_auto)
        if len(choices) > 1:
            split = auto.choose(self.installation.tuner(job.MULTI_COPY), block, original, arguments, split, choices)
        return (AUTO_STEPPED_ASIDE, None) if split is None else (split, arguments)

    def count(self, block, route: CopiesRoute) -> None:
        _last_routes[block] = route
        if route.reason is not None and route.reason not in SAID_ASIDE:
            log.once(("multi-copy", route.reason), logging.WARNING,
                     f"multi-copy: a TransformerBlock runs without copies: {route.reason}")
        if route.backward_in_turn is not None:
            log.once(("multi-copy backward", route.backward_in_turn), logging.WARNING,
                     f"multi-copy: a TransformerBlock's copies run their backward one after the other (no overlap "
                     f"there): {route.backward_in_turn}")
        if self.installation.coverage is not None:
            self.installation.coverage.count(block, route, None, _no_shape)


def wrap(original, multi_copy: MultiCopy):
    """The forward put on TransformerBlock: split, run as copies or Megatron's forward, count."""

    installation = multi_copy.installation

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        verdict = self.__dict__.get(VERDICT)
        if verdict is not None and verdict.value[1] is not None \
                and verdict.holds(installation, self.__dict__.get("config"), self.training):
            route = verdict.value[1]  # every call: Megatron's block, said (and kept in _last_routes) at its first
            if installation.coverage is not None:
                installation.coverage.count(self, route, None, _no_shape)
            return original(self, *args, **kwargs)
        split, arguments = multi_copy.split(self, original, args, kwargs)
        if isinstance(split, str):  # why not
            verdict = self.__dict__.get(VERDICT)
            route = verdict.value[1] if verdict is not None and verdict.value[0] == split else None
            multi_copy.count(self, route or CopiesRoute(1, len(self.layers), split))
            return original(self, *args, **kwargs)
        output, in_turn = copies_block.copies_call(self, original, arguments, split)
        multi_copy.count(self, CopiesRoute(split.copies, len(self.layers), None, in_turn, split.kind))
        return output

    return forward


def per_copy_get_tensor(original):
    """Megatron's global memory buffer hands every caller of a name the same memory (the
    sequence-parallel all-gather's output, for one): a copy gets its own, or the other copy would
    overwrite it while a collective writes it or a matmul reads it. In the backward too (the copy of
    the running node), so that no copy's buffer is shared with a collective another copy left in
    flight."""

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        copy = scheduler.current_copy()
        return original(self, tensor_shape, dtype, name if copy is None else f"{name}@copy{copy}", *args, **kwargs)

    return get_tensor


def last_route(block) -> CopiesRoute | None:
    """The route of ``block``'s last call (tests, the self-test, a user asking), None before its first;
    kept here, not on Megatron's object."""
    return _last_routes.get(block)


_last_routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> its last call's route


def _no_shape(layer, input_) -> list:
    return []


def _has_pieces_layer(block) -> bool:
    """Has ``block`` an MoE layer the MoE wing does not refuse (moe/guards.layer_reason: its construction)?
    Where every one is refused, the copies' candidates with Megatron's dispatcher inside would repeat those
    without: no trial for them. Part of the block's verdict (MultiCopy.decide)."""
    from coc_inject.moe import guards

    return any(guards.layer_reason(layer) is None for layer in copies_moe.moe_layers(block))


def no_collective(block) -> str | None:
    """NO_COLLECTIVE where the block issues no collective the copies could hide (TP 1, CP 1, and no MoE layer
    whose dispatcher reaches another rank), else None: COC_MULTI_COPY=auto runs no trial there."""
    config = block.config
    if getattr(config, "tensor_model_parallel_size", 1) > 1 or (getattr(config, "context_parallel_size", 1) or 1) > 1:
        return None
    for layer in copies_moe.moe_layers(block):
        dispatcher = getattr(layer, "token_dispatcher", None)
        ep = getattr(dispatcher, "ep_size", None) or getattr(config, "expert_model_parallel_size", 1) or 1
        expert_tp = getattr(dispatcher, "tp_size", None) or getattr(config, "expert_tensor_parallel_size", 1) or 1
        if ep > 1 or expert_tp > 1:
            return None
    return NO_COLLECTIVE


_block_readers: dict = {}  # config class -> config -> (allow-list values, BLOCK_READS values)


def _block_reads(cls):
    """``config -> tuple`` of what the block's verdict reads: multi-copy's allow-list and BLOCK_READS, one C call."""
    found = _block_readers.get(cls)
    if found is None:
        names = check.read_names(cls, check.MULTI_COPY)
        names += tuple(name for name in BLOCK_READS if name not in names)
        fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        # Absent from this release's (or a stand-in's) config: the guards read such a field as None.
        found = _block_readers[cls] = check.reader(cls, tuple(name for name in names if name in fields) or names)
    return found
