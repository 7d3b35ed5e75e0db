"""The lab's process group: a ``dist.ProcessGroup`` registered as the "lab" backend, one rank of a
group of N in this process. Every collective, Megatron's and coc-inject's, is a transfer on the
group's lane (:mod:`streams`), as long as the link says (:mod:`links`), writing what
:mod:`outputs` says; a synchronous call waits before it returns (c10d waits on the work), an async
one when its work's ``wait()`` is called. Each method has torch's names of several releases."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from coc_inject.lab import outputs
from coc_inject.lab.streams import Lane

BACKEND = "lab"


@dataclass
class LabState:
    """What every group of the running lab shares: the link, how lanes are made, the modelled time."""

    link: object
    make_streams: object  # () -> ThreadStreams | CudaStreams
    comm_seconds: float = 0.0
    collectives: int = 0
    lanes: list = field(default_factory=list)
    store: object = None

    def new_lane(self) -> Lane:
        lane = Lane(self.make_streams())
        self.lanes.append(lane)
        return lane


_state: LabState | None = None


def set_state(state: LabState | None) -> None:
    global _state
    _state = state


class LabWork(dist.Work):
    def __init__(self, streams, token=None, keep=()):
        super().__init__()
        self.streams, self.token, self.keep = streams, token, keep

    def wait(self, timeout=None):
        if self.token is None:
            raise RuntimeError("a lab receive was waited on before this rank posted the send it pairs with (a receive "
                               "from the rank d places back gets this rank's send d places ahead)")
        self.streams.wait(self.token)
        return True

    def is_completed(self):
        return self.token is not None and self.streams.done(self.token)


class LabGroup(dist.ProcessGroup):
    def __init__(self, rank: int, size: int, state: LabState):
        super().__init__(rank, size)
        self._rank, self._size, self._state = rank, size, state
        self._lane = state.new_lane()
        self._sends: dict = {}  # offset -> deque of (tensor, work) waiting for their receive
        self._recvs: dict = {}

    def size(self):
        return self._size

    def getBackendName(self):
        return BACKEND

    # c10d names a group through the backend it holds; this group is its own backend
    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return getattr(self, "_name", "")

    def _run(self, kind: str, nbytes: int, move, tensors) -> LabWork:
        link = self._state.link
        seconds = link.seconds(kind, nbytes, self._size)
        self._state.comm_seconds += seconds
        self._state.collectives += 1
        token = self._lane.submit(seconds, int(nbytes * link.device_share), move, tensors)
        return LabWork(self._lane.streams, token, tuple(tensors))

    # -- collectives --------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._run("all_reduce", sum(map(outputs.tensor_bytes, tensors)),
                         lambda: [outputs.all_reduce(t, op, self._size) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _allgather_base(self, output, input, opts=None):
        return self._run("all_gather", outputs.tensor_bytes(output),
                         lambda: outputs.all_gather(output, input, self._rank, self._size), [output, input])

    all_gather_single = _allgather_base

    def allgather(self, output_lists, inputs, opts=None):
        outs = output_lists[0]
        return self._run("all_gather", sum(map(outputs.tensor_bytes, outs)),
                         lambda: outputs.all_gather_list(outs, inputs[0], self._rank, self._size), [*outs, inputs[0]])

    def allgather_into_tensor_coalesced(self, outputs_, inputs, opts=None):
        for output, input in zip(outputs_, inputs):
            work = self._allgather_base(output, input, opts)
        return work

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _reduce_scatter_base(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._run("reduce_scatter", outputs.tensor_bytes(input),
                         lambda: outputs.reduce_scatter(output, input, op, self._rank, self._size), [output, input])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs_, inputs, opts=None):
        for output, input in zip(outputs_, inputs):
            work = self._reduce_scatter_base(output, input, opts)
        return work

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        outputs.check_splits(output, input, output_splits, input_splits, self._size)
        return self._run("all_to_all", outputs.tensor_bytes(input), lambda: outputs.all_to_all(output, input),
                         [output, input])

    all_to_all_single = alltoall_base

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", sum(map(outputs.tensor_bytes, tensors)), lambda: None, tensors)

    def barrier(self, opts=None):
        return self._run("p2p", 0, lambda: None, [])

    # -- point to point: a send d places ahead pairs with a receive from d places back ----------------
    def send(self, tensors, dst, tag=0):
        return self._pair(self._sends, self._recvs, (dst - self._rank) % self._size, tensors[0], sending=True)

    def recv(self, tensors, src, tag=0):
        return self._pair(self._recvs, self._sends, (self._rank - src) % self._size, tensors[0], sending=False)

    def _pair(self, mine: dict, theirs: dict, offset: int, tensor, sending: bool) -> LabWork:
        waiting = theirs.get(offset)
        if not waiting:
            work = LabWork(self._lane.streams, None, (tensor,))
            mine.setdefault(offset, deque()).append((tensor, work))
            return work
        other, other_work = waiting.popleft()
        sent, recv = (tensor, other) if sending else (other, tensor)
        work = self._run("p2p", outputs.tensor_bytes(sent), lambda: outputs.received(recv, sent), [sent, recv])
        other_work.token, other_work.keep = work.token, work.keep
        return work


def _create(store, rank, size, timeout=None):
    if _state is None:
        raise RuntimeError("the lab backend makes groups only inside coc_inject.lab.world.lab_world()")
    return LabGroup(rank, size, _state)


_registered = False


def register() -> None:
    """The "lab" backend known to torch.distributed (once a process)."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
        _registered = True
