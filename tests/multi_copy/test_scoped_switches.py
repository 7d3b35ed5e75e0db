"""The package's global switches are scoped: each is set only inside its context manager, and the
value that was there before comes back on the way out, also after an error (multi-copy's poison
mode, the schedules' tracer, the engines' all_reduce_async, each replaced by the tests or the bench)."""

import pytest

from coc_inject.multi_copy import collectives as copies_collectives
from coc_inject.pipeline import collectives as pipeline_collectives
from coc_inject.pipeline import schedules


def _poison():
    return copies_collectives.poisoned(), lambda: copies_collectives._poison, True


def _tracer():
    tracer = schedules.TimelineTracer()
    return schedules.traced(tracer), lambda: schedules._tracer, tracer


def _all_reduce():
    def stub(tensor, group):
        return None

    return pipeline_collectives.all_reduce_replaced(stub), lambda: pipeline_collectives.all_reduce_async, stub


SWITCHES = {"poison": _poison, "tracer": _tracer, "all_reduce_async": _all_reduce}


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_is_set_inside_its_context_and_the_previous_value_comes_back(name):
    context, read, value = SWITCHES[name]()
    before = read()
    with context:
        assert read() is value
        inner, _, inner_value = SWITCHES[name]()
        with inner:  # nested: the outer value comes back, not the default
            assert read() is inner_value
        assert read() is value
    assert read() is before


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_is_put_back_after_an_error_inside(name):
    context, read, value = SWITCHES[name]()
    before = read()
    with pytest.raises(RuntimeError, match="inside"):
        with context:
            assert read() is value
            raise RuntimeError("inside")
    assert read() is before


def test_the_traced_schedule_records_and_an_untraced_one_does_not():
    bounds = [(0, 1), (1, 2)]

    class Work:
        def wait(self):
            return True

        def get_future(self):
            raise RuntimeError("no future")

        def is_completed(self):
            return True

    def communicate(start, stop, computed):
        return Work()

    with schedules.traced(schedules.TimelineTracer()) as tracer:
        schedules.run_compute_first(bounds, lambda start, stop: None, communicate)
    assert [event[0] for event in tracer.finish()].count("compute") == 2
    schedules.run_compute_first(bounds, lambda start, stop: None, communicate)
    assert [event[0] for event in tracer.finish()].count("compute") == 2
