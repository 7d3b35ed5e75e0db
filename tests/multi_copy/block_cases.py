"""One TransformerBlock call with copies on every rank of a gloo pool (TP = the world, SP): what it
leaves behind, what it asks Megatron for, and what a recorder sees (tests/multi_copy/test_multi_copy.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from coc_inject.multi_copy import install as copies_install
from coc_inject.multi_copy.forward import last_route
from tests.context_parallel import cp_gpt_cases
from tests.multi_copy.multi_copy_cases import CollectiveRecorder


def numbers_left_as_they_are(per_copy) -> dict:
    """segments.renumber on a torch whose _set_sequence_nr changed nothing: autograd's own order."""
    return {node._sequence_nr(): copy for copy, (segments_, cut_nodes, *_) in enumerate(per_copy)
            for node in [*(n for segment in segments_ for n in segment), *filter(None, cut_nodes)]}


def block_call(copies=2, record=False, broken_autograd=False):
    """One TransformerBlock call as ``copies`` copies (TP = the world, SP), forward and backward: the
    route it took (forward.last_route), every attribute naming coc-inject left on the block or its
    modules (none may be), the names the copies asked Megatron's global memory buffer for, forward
    and backward, and with ``record`` the collectives recorded (the recorder must change none of it).
    ``broken_autograd``: a torch whose renumbering changes nothing, as install's check sees it."""
    import types

    from megatron.core import utils
    from megatron.core.transformer import transformer_block

    from coc_inject import job
    from coc_inject.testbed.models import build_block
    from coc_inject.config import CocConfig

    world = dist.get_world_size()
    cp_gpt_cases.setup(world, 1)
    sizes = types.SimpleNamespace(layers=1, batch=2 * copies, seq=8 * world, heads=world, hidden=8 * world,
                                  ffn=16 * world)
    block, hidden, mask = build_block(sizes)
    names = set()
    get_tensor = utils.GlobalMemoryBuffer.get_tensor

    def naming(self, tensor_shape, dtype, name, *args, **kwargs):  # beneath coc-inject's: the names it gives
        names.add(("backward" if torch._C._current_autograd_node() is not None else "forward", name))
        return get_tensor(self, tensor_shape, dtype, name, *args, **kwargs)

    recorder = CollectiveRecorder() if record else None
    with contextlib.ExitStack() as inside:
        if broken_autograd:
            from coc_inject.multi_copy import autograd_check, segments

            renumber, segments.renumber = segments.renumber, numbers_left_as_they_are
            autograd_check.reason.cache_clear()
            inside.callback(autograd_check.reason.cache_clear)
            inside.callback(setattr, segments, "renumber", renumber)
        utils.GlobalMemoryBuffer.get_tensor = naming
        inside.callback(setattr, utils.GlobalMemoryBuffer, "get_tensor", get_tensor)
        if recorder is not None:
            inside.enter_context(recorder)
        copies_install.install(CocConfig(multi_copy=copies), transformer_block)
        inside.callback(job.uninstall)
        block(hidden.requires_grad_(), mask).sum().backward()
        route = last_route(block)
    left = sorted(f"{name or 'block'}.{attribute}" for name, module in block.named_modules()
                  for attribute in vars(module) if "coc" in attribute.lower())
    return {"copies": route.copies if route else None, "reason": getattr(route, "reason", None), "left": left,
            "buffers": sorted(names), "collectives": recorder.calls if recorder is not None else None}
