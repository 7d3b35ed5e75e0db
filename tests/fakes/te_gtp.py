"""Test-only stand-ins that let megatron-core's tensor-parallel weight sharding (GTP,
megatron-core >= 0.19) run on CPU + gloo, so its guard can be tested against the real layers.

GTP takes its weight all-gather and wgrad reduce-scatter from Transformer Engine
(``transformer_engine.pytorch.distributed.gather_along_first_dim`` /
``reduce_scatter_along_first_dim``, ``module.base.get_dummy_wgrad``; MagicMocks when TE is missing) and builds CUDA events
and streams. TE cannot be installed here. The fakes below compute the true result of TE's
contract: ``(output, handle)``, output = the inputs of every rank of ``group`` concatenated
(gather) or summed and split (reduce-scatter) along dim 0, ``handle`` the async work or None.
The CUDA event/stream stand-ins order nothing: on CPU every op completes in program order.
What runs unfaked is Megatron's own GTP code (sharding, forward gather, backward RS into
``main_grad``). Never verified against real TE here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def gather_along_first_dim(inp, group, async_op=False, quantizer=None, output_tensor=None):
    assert quantizer is None, "the fake supports unquantized weights only"
    shape = (inp.shape[0] * group.size(), *inp.shape[1:])
    out = output_tensor if output_tensor is not None else torch.empty(shape, dtype=inp.dtype, device=inp.device)
    assert tuple(out.shape) == shape, (tuple(out.shape), shape)
    handle = dist.all_gather_into_tensor(out, inp.contiguous(), group=group, async_op=async_op)
    return out, handle


def reduce_scatter_along_first_dim(inp, group, async_op=False, output=None, **unused):
    assert inp.shape[0] % group.size() == 0, (inp.shape, group.size())
    shape = (inp.shape[0] // group.size(), *inp.shape[1:])
    out = output if output is not None else torch.empty(shape, dtype=inp.dtype, device=inp.device)
    handle = dist.reduce_scatter_tensor(out, inp.contiguous(), group=group, async_op=async_op)
    return out, handle


def get_dummy_wgrad(shape, dtype, zero=False):
    """TE's shared placeholder wgrad returned to autograd once the real one is in main_grad."""
    return (torch.zeros if zero else torch.empty)(list(shape), dtype=dtype)


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream(_Event):
    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass


def install() -> None:
    """Point megatron-core's GTP module at the fakes (idempotent; worker processes only)."""
    import megatron.core.tensor_parallel.generalized_tensor_parallelism as gtp

    gtp.gather_along_first_dim = gather_along_first_dim
    gtp.reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
    gtp.get_dummy_wgrad = get_dummy_wgrad
    torch.cuda.Event = _Event
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
