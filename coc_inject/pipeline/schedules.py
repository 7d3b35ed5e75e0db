"""The two CoC schedules. Which one a case uses follows from its data dependency.

* compute-first: chunk i is computed, then its collective starts and runs while chunk i+1
  computes (matmul -> all-reduce / reduce-scatter).
* comm-first: the collective for chunk i+1 is started before chunk i is computed, so the
  communication of the next chunk runs while this one computes (all-gather -> matmul).

Both return only once every collective has completed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from enum import Enum
from typing import Callable, Sequence

from coc_inject.meter import now, span
from coc_inject.pipeline.collectives import wait_all

_tracer = None  # inside traced() only (the bench's timeline); None in normal runs


@contextlib.contextmanager
def traced(tracer):
    """Inside, both schedules record their chunks' times in ``tracer`` (a :class:`TimelineTracer`); the
    previous tracer comes back on the way out, also after an error."""
    global _tracer
    before, _tracer = _tracer, tracer
    try:
        yield tracer
    finally:
        _tracer = before


class Schedule(Enum):
    COMPUTE_FIRST = "compute-first"
    COMM_FIRST = "comm-first"


def run_compute_first(
    bounds: Sequence[tuple[int, int]],
    compute: Callable[[int, int], object],
    communicate: Callable[[int, int, object], object],
    overlap: Callable[[], None] | None = None,
) -> None:
    """``compute(start, stop)`` then start ``communicate(start, stop, computed)`` per chunk.

    ``overlap`` (optional) is extra local work run while the last collectives are in flight.
    """
    if _tracer is not None:
        compute, communicate = _tracer.wrap(compute, communicate)
    handles = []
    for start, stop in bounds:
        handles.append(communicate(start, stop, compute(start, stop)))
    if overlap is not None:
        overlap()
    wait_all(handles)


def run_comm_first(
    bounds: Sequence[tuple[int, int]],
    communicate: Callable[[int, int], object],
    compute: Callable[[int, int], None],
) -> None:
    """Start ``communicate`` for chunk i+1, wait for chunk i's, then ``compute`` chunk i."""
    if _tracer is not None:
        compute, communicate = _tracer.wrap(compute, communicate)
    pending = communicate(*bounds[0])
    for index, (start, stop) in enumerate(bounds):
        ready = pending
        if index + 1 < len(bounds):
            pending = communicate(*bounds[index + 1])
        wait_all([ready])
        compute(start, stop)



class TimelineTracer:
    """Records when each chunk's matmul ran and when its collective was issued and completed.

    Host clock (coc_inject.meter); completion comes from the work's future callback, so
    it is when the backend finished, not when the schedule got round to waiting. On GPUs the
    host times show launches, not kernel execution.
    """

    def __init__(self):
        # (kind, chunk start row, t_begin, t_end); kind: "compute", "launch" (host time to
        # start the collective), "comm" (issued -> completed)
        self.events = []
        self._pollers = []

    def finish(self) -> list:
        """Wait for completion times still being recorded; return the events."""
        for poller in self._pollers:
            poller.join()
        return self.events

    def wrap(self, compute, communicate):
        events, pollers = self.events, self._pollers

        def traced_compute(start, stop, *rest):
            with span(events, "compute", start):
                return compute(start, stop, *rest)

        def traced_communicate(start, stop, *rest):
            begin = now()
            handle = communicate(start, stop, *rest)
            events.append(("launch", start, begin, now()))
            record = ["comm", start, begin, None]
            events.append(record)
            try:
                handle.get_future().add_done_callback(lambda _: record.__setitem__(3, now()))
            except (AttributeError, RuntimeError):  # e.g. gloo reduce-scatter has no future: poll
                poller = threading.Thread(target=_poll_completion, args=(handle, record), daemon=True)
                poller.start()
                pollers.append(poller)
                return _WaitRecorded(handle, record)
            return handle

        return traced_compute, traced_communicate


class _WaitRecorded:
    """A polled handle whose ``wait()`` also records completion: some works never report
    ``is_completed()`` (gloo's ``reduce_scatter_single`` / ``all_gather_single`` in torch 2.13),
    and the schedule always waits for every handle, so the poller stops at the latest then."""

    def __init__(self, handle, record):
        self._handle, self._record = handle, record

    def wait(self, *args, **kwargs):
        result = self._handle.wait(*args, **kwargs)
        if self._record[3] is None:
            self._record[3] = now()
        return result

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _poll_completion(handle, record) -> None:
    while record[3] is None and not handle.is_completed():
        time.sleep(0.0002)
    if record[3] is None:
        record[3] = now()
