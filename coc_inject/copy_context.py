"""Which copy of a multi-copy run the calling thread is, if any: what the linears, the tuner and the
collectives' interception read, written by the multi-copy runs (scheduler.py, segments.py; stdlib only, bottom floor, so
that the rooms reading it need not know the wing above them)."""

from __future__ import annotations

import contextlib
import threading

_current = threading.local()


def enter(run, index: int) -> None:
    """The calling thread now runs copy ``index`` of ``run`` (the scheduler's CopyRun)."""
    _current.run, _current.index = run, index


def leave() -> None:
    _current.run = _current.index = None


def current():
    """The run the calling thread is a copy of, or None outside copies."""
    return getattr(_current, "run", None)


def current_copy() -> int | None:
    return getattr(_current, "index", None)


def linears_chunked() -> bool:
    """May CoC chunk a tuned linear here? Not inside copies whose block chose Megatron's linears."""
    run = current()
    return run is None or run.inner.linears


def experts_in_pieces() -> bool:
    """May a tuned MoE layer run as pieces here? Not inside copies whose block chose Megatron's dispatcher."""
    run = current()
    return run is None or run.inner.experts


@contextlib.contextmanager
def alone():
    """No hand-over inside: the calling copy keeps the baton (an auto tuner's trials, whose timings
    another copy's work would disturb); its collectives are waited for where they are."""
    run = current()
    if run is None:
        yield
        return
    run.alone += 1
    try:
        yield
    finally:
        run.alone -= 1
