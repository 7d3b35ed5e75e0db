"""The host clock of everything that records when something happened: timestamps and spans.

``now()`` is the one clock (seconds, monotonic, high resolution); :func:`span` records how long a
block ran as ``(*labels, begin, end)`` into a list; a :class:`Recorder` keeps such spans by kind,
each labelled with the phase it ran in. The pipeline's traced timeline
(pipeline/schedules.py) and the bench's traces of the ring (bench/cases/attention.py) record with
it; durations to compare (medians, MAX over ranks) are coc_inject.timer's. Stdlib only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


def now() -> float:
    """The host clock, in seconds (only differences mean anything)."""
    return time.perf_counter()


@contextmanager
def span(into: list, *labels):
    """Appends ``(*labels, begin, end)`` to ``into`` once the block has run (also after an error)."""
    begin = now()
    try:
        yield
    finally:
        into.append((*labels, begin, now()))


class Recorder:
    """Spans by kind, each ``(phase, *labels, begin, end)``: ``recorder.span("transfer", ...)`` around
    a block, ``recorder.phase`` what is running now (e.g. "forward", then "backward");
    ``recorder.of(kind)`` the kind's spans in the order they ended."""

    def __init__(self, phase=None):
        self.phase, self._spans = phase, {}

    def span(self, kind: str, *labels):
        return span(self._spans.setdefault(kind, []), self.phase, *labels)

    def of(self, kind: str) -> list:
        return self._spans.get(kind, [])
