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


def beside_mindspeeds_block_forward(copies=2, replacement="te_basic", recompute=False):
    """MindSpeed 26.0+'s order: coc-inject's hook installs when Megatron's transformer_block is imported, then
    MindSpeed's patch manager sets its own TransformerBlock.forward (tests/fakes/mindspeed_patches.py:
    ``te_basic``, the block forward coc-inject reads as Megatron's, restated; ``unread``, another), then the
    model is built and trained: one block call (TP = the world, SP; ``recompute``: full, uniform), forward
    and backward. Returns the output, the input's and parameters' gradients, the block's route, the calls
    the coverage counted by route, what the report says was taken over, and the banner's and said lines."""
    import types

    from megatron.core.transformer import transformer_block

    from coc_inject import job, mindspeed
    from coc_inject.config import CocConfig
    from coc_inject.testbed.models import build_block
    from tests.fakes import mindspeed_patches as fake

    cls = transformer_block.TransformerBlock
    held = {name: cls.__dict__[name] for name in ("forward", "__init__", "_checkpointed_forward") if name in vars(cls)}
    world = dist.get_world_size()
    cp_gpt_cases.setup(world, 1)
    applied = fake.Applied()
    try:
        if copies != 1:
            copies_install.install(CocConfig(multi_copy=copies), transformer_block)
        coverage = job.current().armed_coverage() if copies != 1 else None
        {"te_basic": fake.te_basic_block_forward, "unread": fake.unread_block_forward}[replacement](applied)
        sizes = types.SimpleNamespace(layers=2, batch=4, seq=8 * world, heads=world, hidden=8 * world, ffn=16 * world,
                                      recompute=recompute)
        block, hidden, mask = build_block(sizes)
        said = {"said": list(mindspeed.said.get(mindspeed.MULTI_COPY, [])),
                "forward": mindspeed.defined_in(cls.__dict__["forward"])}
        if replacement == "unread":  # its stand-in is not run here: what coc-inject did and says is the answer
            return {**said, "taken_over": coverage.report()["taken_over"] if coverage is not None else {}}
        hidden.requires_grad_()
        output = block(hidden, mask)
        output.backward(torch.linspace(-1.0, 1.0, output.numel()).reshape(output.shape))
        route = last_route(block)
        report = coverage.report() if coverage is not None else {}
        return {**said, "output": output.detach(), "grad": hidden.grad,
                "params": {name: p.grad.clone() for name, p in block.named_parameters()},
                "route": None if route is None else (route.copies, route.reason),
                "in_turn": None if route is None else route.backward_in_turn,
                "calls": report.get("calls", {}), "taken_over": report.get("taken_over", {}),
                "layers": [entry for entry in report.get("layers", []) if entry.get("type") == "TransformerBlock"],
                "summary": coverage.summary_line() if coverage is not None else ""}
    finally:
        job.uninstall()
        applied.undo()
        for name, original in held.items():  # MindSpeed never leaves: its patch stays after coc-inject's uninstall
            setattr(cls, name, original)
        mindspeed.forget()
