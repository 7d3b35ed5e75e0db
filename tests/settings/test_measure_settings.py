"""COC_MEASURE's and COC_TRACE's settings (#36): bad values, and refinements given without what they
refine, each one error naming the variable, the value as typed and what is allowed."""

from __future__ import annotations

import pytest

from coc_inject.config import ConfigError, load_config
from coc_inject.settings import table

MEASURE_ALLOWED = table.MEASURE_ALLOWED
TRACE_STEPS_ALLOWED = table.TRACE_STEPS_ALLOWED
EVERY_ALLOWED = table.BY_FIELD["measure_every"].kind.allowed
WARN_ALLOWED = table.BY_FIELD["measure_warn"].kind.allowed


def error_of(environ) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(environ)
    return info.value


@pytest.mark.parametrize("environ,variable,value,allowed", [
    ({"COC_MEASURE": "x"}, "COC_MEASURE", "x", MEASURE_ALLOWED),
    ({"COC_MEASURE": "3-2"}, "COC_MEASURE", "3-2", MEASURE_ALLOWED),  # backwards
    ({"COC_MEASURE": "0-4"}, "COC_MEASURE", "0-4", MEASURE_ALLOWED),  # steps count from 1
    ({"COC_MEASURE": "1", "COC_MEASURE_EVERY": "-1"}, "COC_MEASURE_EVERY", "-1", EVERY_ALLOWED),
    ({"COC_MEASURE": "1", "COC_MEASURE_WARN": "101"}, "COC_MEASURE_WARN", "101", WARN_ALLOWED),
    ({"COC_TRACE": "/tmp/coc-trace", "COC_TRACE_STEPS": "5-2"}, "COC_TRACE_STEPS", "5-2", TRACE_STEPS_ALLOWED),
    # a refinement alone: what to set too
    ({"COC_TRACE_STEPS": "3"}, "COC_TRACE_STEPS", "3", "COC_TRACE=DIR set too"),
    ({"COC_MEASURE": "1", "COC_TRACE_STEPS": "2-4"}, "COC_TRACE_STEPS", "2-4", "COC_TRACE=DIR set too"),
    ({"COC_MEASURE_EVERY": "2"}, "COC_MEASURE_EVERY", "2", "COC_MEASURE=1 (or a step range) or COC_TRACE set too"),
    ({"COC_MEASURE": "0", "COC_MEASURE_WARN": "10"}, "COC_MEASURE_WARN", "10",
     "COC_MEASURE=1 (or a step range) or COC_TRACE set too"),
])
def test_bad_measure_settings_name_the_variable_the_value_and_what_is_allowed(environ, variable, value, allowed):
    error = error_of(environ)
    text = str(error)
    assert error.variable == variable and "\n" not in text
    assert text.startswith(f"{variable}={value!r} "), text  # the value as typed, not as parsed
    assert allowed in text, text


@pytest.mark.parametrize("environ,measure,every,warn,trace_steps", [
    ({"COC_MEASURE": "1"}, (1, None), 0, 20, (2, 2)),
    ({"COC_MEASURE": "on", "COC_MEASURE_EVERY": "5", "COC_MEASURE_WARN": "0"}, (1, None), 5, 0, (2, 2)),
    ({"COC_MEASURE": "2-3"}, (2, 3), 0, 20, (2, 2)),
    ({"COC_MEASURE": "4-"}, (4, None), 0, 20, (2, 2)),
    ({"COC_MEASURE": "off"}, None, 0, 20, (2, 2)),
    ({"COC_TRACE": "/tmp/coc-trace", "COC_TRACE_STEPS": "3-5", "COC_MEASURE_WARN": "100%"}, None, 0, 100, (3, 5)),
])
def test_good_measure_settings_parse(environ, measure, every, warn, trace_steps):
    config = load_config(environ)
    assert (config.measure, config.measure_every, config.measure_warn, config.trace_steps) == (
        measure, every, warn, trace_steps)
