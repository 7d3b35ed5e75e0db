"""The clock of a collective's times: the host's on CPU ranks; on CUDA / NPU, events on the current
(compute) stream, resolved later onto the host's timeline without a host sync.

A device collective's issue and wait return at once on the host: the compute stream waits, not the
host. So each mark is an event recorded on the current stream, and a step's events are read once
they have completed (``query()``, at the step's end or a few steps later); the first mark of a step
(:meth:`DeviceClock.anchor`) ties the events to the host clock. The fake in ``tests/fakes/`` holds
this class to that call contract.
"""

from __future__ import annotations

from coc_inject import meter


def device_module(device_type: str):
    """``torch.cuda`` / ``torch.npu`` for a tensor on that device, else None (the host's clock)."""
    if device_type == "cpu":
        return None
    import torch

    return getattr(torch, device_type, None)


def capturing(device_type: str) -> bool:
    """Whether the current stream of that device is being captured into a graph (CUDA graphs, an NPU
    graph): an event recorded there would be replayed with the graph, not timed, so nothing is metered."""
    module = device_module(device_type)
    probe = getattr(module, "is_current_stream_capturing", None)
    return bool(probe is not None and probe())


class DeviceClock:
    """Events of one device kind (``module``: torch.cuda or torch.npu)."""

    def __init__(self, module):
        self.module = module
        self.anchor_event = None
        self.anchor_host = None

    def mark(self):
        event = self.module.Event(enable_timing=True)
        event.record()
        return event

    def anchor(self) -> None:
        """The step's first mark, and the host's time then: every later event is placed after it."""
        self.anchor_event, self.anchor_host = self.mark(), meter.now()

    def ready(self, events) -> bool:
        return all(event.query() for event in events) and (self.anchor_event is None or self.anchor_event.query())

    def seconds(self, event) -> float:
        """An event's time on the host clock (it and the anchor must have completed)."""
        return self.anchor_host + self.anchor_event.elapsed_time(event) / 1000.0


def resolve(record, clock: DeviceClock) -> bool:
    """The record's device marks turned into host-clock times, once all have completed; False (kept for
    later) while one has not. Marks: ``(issued, [(wait begin, wait end)], done or None)``."""
    issued, waits, done = record.marks
    events = [issued, *(e for pair in waits for e in pair)] + ([done] if done is not None else [])
    if not clock.ready(events):
        return False
    record.issued = clock.seconds(issued)
    record.waits = [(clock.seconds(begin), clock.seconds(end)) for begin, end in waits]
    record.done = clock.seconds(done) if done is not None else None
    record.marks = None
    return True
