"""The two CoC schedules. Which one a case uses follows from its data dependency.

* compute-first: chunk i is computed, then its collective starts and runs while chunk i+1
  computes (matmul -> all-reduce / reduce-scatter).
* comm-first: the collective for chunk i+1 is started before chunk i is computed, so the
  communication of the next chunk runs while this one computes (all-gather -> matmul).

Both return only once every collective has completed.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

from coc_inject.pipeline.collectives import wait_all


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
    pending = communicate(*bounds[0])
    for index, (start, stop) in enumerate(bounds):
        ready = pending
        if index + 1 < len(bounds):
            pending = communicate(*bounds[index + 1])
        wait_all([ready])
        compute(start, stop)

