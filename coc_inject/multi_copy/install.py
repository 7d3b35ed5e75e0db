"""install() / uninstall() of multi-copy parallel: TransformerBlock.forward and the collectives.

* ``megatron.core.transformer.transformer_block``: ``TransformerBlock.forward`` runs a call as
  copies (block.py) or, with the reason counted, Megatron's own forward.
* ``torch.distributed``'s collectives and Megatron's aliases of them: inside a copy, a wait for
  the network hands the baton on (collectives.py); outside copies they call through.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys

import torch.distributed as dist

from coc_inject.multi_copy import auto, block as copies_block, collectives, scheduler

logger = logging.getLogger("coc_inject.multi_copy")

_originals: dict = {}  # (owner, attribute) -> original
AUTO = "auto"
_state = {"copies": 1, "on_route": None, "tuner": None}


def _patch(owner, name, replacement) -> None:
    _originals[(owner, name)] = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, replacement)


def install(copies, transformer_block_module, on_route=None, tuner=None) -> None:
    """Run every TransformerBlock call as ``copies`` copies (an integer >= 2, or AUTO: decided per
    call shape by ``tuner``). ``on_route(block, copies, reason)`` is told each call's route (the
    copies, or 1 with the reason). Idempotent."""
    uninstall()
    _state.update(copies=copies, on_route=on_route, tuner=tuner)
    _patch_collectives()
    _patch_memory_buffer()
    _patch_grad_ready()
    cls = transformer_block_module.TransformerBlock
    _patch(cls, "forward", _copies_forward(cls.__dict__["forward"]))


def uninstall() -> None:
    for (owner, name), original in reversed(list(_originals.items())):
        setattr(owner, name, original)
    _originals.clear()
    _state.update(copies=1, on_route=None, tuner=None)


def _patch_collectives() -> None:
    wrappers = {}  # what a Megatron alias may hold (the torch function, or an instrumentation of it) -> ours
    for name in collectives.COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            wrapper = collectives.wrap(original)
            wrappers[original] = wrappers[inspect.unwrap(original)] = wrapper
            _patch(dist, name, wrapper)
    _patch(dist, "batch_isend_irecv", collectives.wrap_batch(dist.batch_isend_irecv))
    for module_name, names in collectives.MEGATRON_ALIASES.items():
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        for name in names:
            value = getattr(module, name, None)
            if value in wrappers:
                _patch(module, name, wrappers[value])


def _patch_memory_buffer() -> None:
    """Megatron's global memory buffer hands every caller of a name the same memory (the
    sequence-parallel all-gather's input, for one): a copy gets its own, or the other copy would
    overwrite it while a collective reads it."""
    from megatron.core import utils

    cls = utils.GlobalMemoryBuffer
    original = cls.__dict__["get_tensor"]

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        copy = scheduler.current_copy()
        return original(self, tensor_shape, dtype, name if copy is None else f"{name}@copy{copy}", *args, **kwargs)

    _patch(cls, "get_tensor", get_tensor)


def _patch_grad_ready() -> None:
    """Megatron's DDP with overlap_grad_reduce counts a parameter's gradient ready once per
    micro-batch ("Cannot set grad twice"); with copies it accumulates once per copy: the bucket
    hears of it at the last copy's, when the whole gradient is in."""
    try:
        from megatron.core.distributed import param_and_grad_buffer
    except ImportError:
        return
    cls = getattr(param_and_grad_buffer, "_ParamAndGradBucketGroup", None)
    if cls is None or "register_grad_ready" not in cls.__dict__:
        return
    original = cls.__dict__["register_grad_ready"]

    @functools.wraps(original)
    def register_grad_ready(self, param, *args, **kwargs):
        run = scheduler.current()
        if run is not None and run.count_once(param) < run.n:
            return None
        return original(self, param, *args, **kwargs)

    _patch(cls, "register_grad_ready", register_grad_ready)


def _copies_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        copies = 2 if _state["copies"] == AUTO else _state["copies"]
        reason = copies_block.block_reason(self, copies)
        split = None
        if reason is None:
            split = copies_block.plan(self, copies, copies_block.bind(original, self, args, kwargs))
            if isinstance(split, str):
                reason, split = split, None
        if split is not None and _state["copies"] == AUTO and auto.choose(
                _state["tuner"], self, original, args, kwargs, split) == 1:
            split, reason = None, "auto: no copies were faster for this shape"
        _tell(self, split.copies if split else 1, reason)
        if split is None:
            return original(self, *args, **kwargs)
        output, _ = copies_block.run_copies(self, original, args, kwargs, split)
        return output

    forward.__coc_multi_copy__ = True
    return forward


def _tell(block, copies, reason) -> None:
    if _state["on_route"] is not None:
        _state["on_route"](block, copies, reason)
