"""COC_MEASURE's meter against a known answer: a sleep-backed fake collective (its work's future
completed by a timer ``DURATION`` after its issue, the true end noted), wrapped by the meter's own
wrapper, in two schedules: waited for at once (all of it exposed: the meter's exposed time within 10%
of the collective's true time, hidden 0%) and covered by compute twice as long (exposed 0, hidden
~100%). On the host clock, the same on every device; errors relative to the collective's time, the
MAX over ranks."""

from __future__ import annotations

import threading
import time

from coc_inject.selftest.common import max_over_ranks, row

WING = "meter"
DURATION = 0.5  # seconds: long against a loaded host's wake-ups (a rank 26 ms late at 200 ms under load 19)
BOUND = 0.10
BACKEND = "sleep fake, host clock"


class _Work:
    def __init__(self, future):
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()
        return True

    def get_future(self):
        return self._future


def _fake_collective(span: list):
    """``all_reduce(tensor, group=None, async_op=False)`` taking DURATION; ``span`` gets [start, end]."""
    import torch

    from coc_inject import meter

    def all_reduce(tensor, group=None, async_op=False, op=None):
        future = torch.futures.Future()
        span[:] = [meter.now(), None]

        def finish():
            span[1] = meter.now()
            future.set_result([tensor])

        timer = threading.Timer(DURATION, finish)
        timer.daemon = True
        timer.start()
        work = _Work(future)
        if not async_op:
            work.wait()
            return None
        return work

    return all_reduce


def _schedule(compute_s: float) -> tuple:
    """(the meter's first-step total, the collective's true [start, end]) for: issue, compute, wait."""
    import torch

    from coc_inject.config import CocConfig
    from coc_inject.measure import metered
    from coc_inject.measure.exposure import Exposure

    exposure = Exposure(CocConfig(measure=(1, None)))
    span = []
    all_reduce = metered.wrapper(exposure, "all_reduce", _fake_collective(span))
    work = all_reduce(torch.zeros(4), async_op=True)
    if compute_s:
        time.sleep(compute_s)
    work.wait()
    exposure.end_step()
    return exposure.first["total"], span


def run(ctx) -> list:
    rows = []
    for case, compute_s in (("waited at once: all exposed", 0.0), ("covered by 2x compute: hidden", 2 * DURATION)):
        ctx.progress(WING, case)
        total, (start, end) = _schedule(compute_s)
        truth_s = end - start
        if compute_s:
            errors = {"exposed": total["exposed_s"] / DURATION, "hidden %": (100.0 - total["hidden_pct"]) / 100.0}
            expected_exposed = 0.0
        else:
            errors = {"exposed": abs(total["exposed_s"] - truth_s) / truth_s, "hidden %": total["hidden_pct"] / 100.0}
            expected_exposed = truth_s
        errors["communication"] = abs(total["communication_s"] - truth_s) / truth_s
        errors = {what: max_over_ranks(error, ctx.group, ctx.device) for what, error in errors.items()}
        rows.append(row(WING, case, BACKEND, errors, "host", coc_ms=1e3 * total["exposed_s"],
                        reference_ms=1e3 * expected_exposed, bound=BOUND, hidden_pct=total["hidden_pct"],
                        communication_ms=1e3 * total["communication_s"], truth_ms=1e3 * truth_s))
    return rows
