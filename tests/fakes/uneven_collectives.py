"""NCCL's uneven list forms of ``all_gather`` and ``reduce_scatter`` on the tests' gloo ranks (test-only).

With expert tensor parallelism Megatron gathers and reduce-scatters uneven row counts with the list forms,
which gloo refuses ("invalid tensor size"). The stand-ins pad every part to the largest and run the tensor
forms: the same sums, synchronous only (they assert it). Even sizes go to torch's own functions."""

from __future__ import annotations

import torch.distributed as dist

_even: dict = {}  # torch's own list forms, for even sizes (async ones too)


def install() -> None:
    if not _even:  # once per process: torch's own, never a wrapper of these
        _even.update(all_gather=dist.all_gather, reduce_scatter=dist.reduce_scatter)
        dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def all_gather(outputs, tensor, group=None, async_op=False):
    if all(out.shape == tensor.shape for out in outputs):
        return _even["all_gather"](outputs, tensor, group=group, async_op=async_op)
    width = max(out.shape[0] for out in outputs)
    padded = tensor.new_zeros((width,) + tuple(tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = tensor.new_empty((width * len(outputs),) + tuple(tensor.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for rank, out in enumerate(outputs):
        out.copy_(gathered[rank * width:rank * width + out.shape[0]])
    assert not async_op


def reduce_scatter(output, inputs, group=None, async_op=False, **kwargs):
    if all(t.shape == output.shape for t in inputs):
        return _even["reduce_scatter"](output, inputs, group=group, async_op=async_op, **kwargs)
    width = max(t.shape[0] for t in inputs)
    padded = inputs[0].new_zeros((width * len(inputs),) + tuple(inputs[0].shape[1:]))
    for rank, t in enumerate(inputs):
        padded[rank * width:rank * width + t.shape[0]] = t
    out = output.new_empty((width,) + tuple(output.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    output.copy_(out[:output.shape[0]])
    assert not async_op
