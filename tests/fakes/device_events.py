"""A fake of the event half of ``torch.cuda`` / ``torch.npu`` (``Event(enable_timing=True)``,
``record()``, ``query()``, ``elapsed_time()``, ``synchronize()``), holding COC_MEASURE's device clock
(coc_inject/measure/clocks.py) to the contract of the real ones, with every call logged.

The device runs behind the host: an event recorded at device time ``device.now`` (set by the test)
completes only when the test says the device got there (:meth:`FakeDevice.run_until`, or
``synchronize()``, which finishes everything recorded). As on CUDA, ``elapsed_time`` raises unless
both events were created with timing enabled, recorded, and completed; ``query()`` on an event never
recorded is True (nothing to wait for).
"""

from __future__ import annotations


class EventError(RuntimeError):
    pass


class FakeDevice:
    """The module the meter sees in place of ``torch.cuda``: ``FakeDevice().Event(...)``."""

    def __init__(self, name: str = "fake_cuda"):
        self.__name__ = name
        self.now = 0.0  # the device's time, milliseconds, where the next record() lands
        self.reached = float("-inf")  # the device has run every event recorded at or before this
        self.calls: list = []  # ("Event", timing), ("record", id), ("query", id), ("elapsed_time", a, b), ("synchronize",)
        self.events: list = []
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
                self.timing, self.at, self.id = enable_timing, None, len(device.events)
                device.events.append(self)
                device.calls.append(("Event", enable_timing))

            def record(self, stream=None):
                device.calls.append(("record", self.id))
                self.at = device.now

            def query(self) -> bool:
                device.calls.append(("query", self.id))
                return self.at is None or self.at <= device.reached

            def elapsed_time(self, end) -> float:
                device.calls.append(("elapsed_time", self.id, end.id))
                for event in (self, end):
                    if not event.timing:
                        raise EventError("Both events must be created with argument 'enable_timing=True'")
                    if event.at is None:
                        raise EventError("Both events must be recorded before calculating elapsed time")
                    if event.at > device.reached:
                        raise EventError("Both events must be completed before calculating elapsed time")
                return end.at - self.at

            def synchronize(self):
                device.calls.append(("event.synchronize", self.id))
                device.reached = max(device.reached, self.at or device.reached)

        self.Event = Event

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize",))
        self.reached = max([self.reached] + [e.at for e in self.events if e.at is not None])

    def run_until(self, time_ms: float) -> None:
        """The device has run everything recorded up to ``time_ms`` (what a later step's end finds)."""
        self.reached = time_ms

    def names(self, since: int = 0) -> list:
        """The calls' names from the ``since``-th on."""
        return [call[0] for call in self.calls[since:]]
