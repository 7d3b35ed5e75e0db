"""One piece's data movements, one class per collective, each started asynchronously and finished
later, and a :class:`Chain` that runs a piece's movements one after the other.

A movement works on a list of tensors (a piece's tokens and probs travel together) and returns the
moved list from ``finish()``. The all-gather and reduce-scatter over the expert tensor-parallel
group move uneven row counts: every rank's rows are padded to the largest count, so one
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` does it on every backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAll:
    """Rows to every rank of ``group``: ``send[r]`` rows to rank r, ``receive[r]`` rows from it."""

    def __init__(self, send: list, receive: list, group):
        self.send, self.receive, self.group = send, receive, group

    def start(self, tensors: list) -> "AllToAll":
        self.outputs, self.works = [], []
        for tensor in tensors:
            out = tensor.new_empty((sum(self.receive),) + tuple(tensor.shape[1:]))
            self.works.append(dist.all_to_all_single(out, tensor.contiguous(), self.receive, self.send,
                                                     group=self.group, async_op=True))
            self.outputs.append(out)
        return self

    def finish(self) -> list:
        for work in self.works:
            work.wait()
        return self.outputs


class AllGatherRows:
    """Every rank's rows, rank-major (``sizes[r]``: rank r's rows); ``via``: the dtype they travel in."""

    def __init__(self, sizes: list, group, via=None):
        self.sizes, self.group, self.via = sizes, group, via

    def start(self, tensors: list) -> "AllGatherRows":
        width = max(self.sizes)
        self.dtypes, self.outputs, self.works = [t.dtype for t in tensors], [], []
        for tensor in tensors:
            tensor = tensor.to(self.via or tensor.dtype)
            padded = tensor.new_zeros((width,) + tuple(tensor.shape[1:]))
            padded[:tensor.shape[0]] = tensor
            out = tensor.new_empty((width * len(self.sizes),) + tuple(tensor.shape[1:]))
            self.works.append(dist.all_gather_into_tensor(out, padded, group=self.group, async_op=True))
            self.outputs.append(out)
        return self

    def finish(self) -> list:
        width = max(self.sizes)
        for work in self.works:
            work.wait()
        return [torch.cat([out[r * width:r * width + n] for r, n in enumerate(self.sizes)]).to(dtype)
                for out, dtype in zip(self.outputs, self.dtypes)]


class ReduceScatterRows:
    """Rank-major rows (``sizes[r]`` for rank r) summed over ``group``; this rank keeps its own."""

    def __init__(self, sizes: list, group, via=None):
        self.sizes, self.group, self.via = sizes, group, via

    def start(self, tensors: list) -> "ReduceScatterRows":
        width = max(self.sizes)
        self.dtypes, self.outputs, self.works = [t.dtype for t in tensors], [], []
        for tensor in tensors:
            tensor = tensor.to(self.via or tensor.dtype)
            padded = tensor.new_zeros((width * len(self.sizes),) + tuple(tensor.shape[1:]))
            offset = 0
            for r, n in enumerate(self.sizes):
                padded[r * width:r * width + n] = tensor[offset:offset + n]
                offset += n
            out = tensor.new_empty((width,) + tuple(tensor.shape[1:]))
            self.works.append(dist.reduce_scatter_tensor(out, padded, group=self.group, async_op=True))
            self.outputs.append(out)
        return self

    def finish(self) -> list:
        mine = self.sizes[self.group.rank()]
        for work in self.works:
            work.wait()
        return [out[:mine].to(dtype) for out, dtype in zip(self.outputs, self.dtypes)]


class Chain:
    """A piece's movements in order: ``start`` the first, ``advance`` to the next once the running
    one is done, ``finish`` all. Where each is called is the schedule's program order, the same on
    every rank."""

    def __init__(self, movements: list, tensors: list):
        self.movements = list(movements)
        self.running = self.movements.pop(0).start(tensors)

    def advance(self) -> None:
        if self.movements:
            self.running = self.movements.pop(0).start(self.running.finish())

    def finish(self) -> list:
        while self.movements:
            self.advance()
        return self.running.finish()
