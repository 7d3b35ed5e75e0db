"""COC_TRACE's Chrome trace (coc_inject/measure/trace.py), built from constructed records: it loads,
keeps the trace event format's rules (a small schema check below), puts every collective on its
group's track from issue to done, the waits inside the step and the compute between them."""

import json
import logging

import pytest

from coc_inject.measure import trace
from coc_inject.measure.records import Collective, communication_times

BEGIN, END = 100.0, 100.010  # a 10 ms step, host-clock seconds
LAYERS = {11: "decoder.layers.0.mlp.linear_fc2", 12: "decoder.layers.0.self_attention"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index", "process_labels"}


def _record(wing, op, group, nbytes, layer, phase, issued, waits, done, copy=None):
    record = Collective(wing, op, group, nbytes, layer, phase, BEGIN + issued / 1e3, copy)
    record.waits = [(BEGIN + b / 1e3, BEGIN + e / 1e3) for b, e in waits]
    record.done = BEGIN + done / 1e3
    return record


def step_records():
    """Times in ms from the step's begin: two TP all-reduces in flight together, a CP exchange long in flight,
    a copy's all-gather whose wait overlaps another wait, a synchronous all-reduce on the world."""
    return [_record("linears", "all_reduce", "tp", 4096, 11, "forward", 1.0, [(3.0, 4.0)], 4.0),
            _record("linears", "all_reduce", "tp", 4096, 11, "forward", 1.5, [(4.5, 5.0)], 5.0),
            _record("context_parallel", "batch_isend_irecv", "cp", 1 << 20, 12, "backward", 2.0, [(7.5, 8.0)], 8.0),
            _record("multi_copy", "all_gather", "tp", 2048, None, "backward", 6.0, [(7.8, 8.5)], 8.5, copy=1),
            _record("megatron optimizer", "all_reduce", "world", 64, None, "optimizer", 9.0, [(9.0, 9.5)], 9.5)]


def build(records=None):
    records = step_records() if records is None else records
    document = trace.document(3, 2, BEGIN, END, records, communication_times(records), LAYERS)
    return json.loads(json.dumps(document)), records


def chrome_trace_problems(document) -> list:
    """The trace event format's rules this project relies on, checked."""
    problems = []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["no traceEvents list"]
    if document.get("displayTimeUnit") not in (None, "ms", "ns"):
        problems.append(f"displayTimeUnit {document['displayTimeUnit']!r}")
    open_async, spans = {}, {}
    for index, event in enumerate(document["traceEvents"]):
        missing = [key for key in ("ph", "ts", "pid", "tid", "name") if key not in event]
        if missing:
            problems.append(f"event {index} lacks {missing}")
            continue
        if not isinstance(event["ts"], (int, float)):
            problems.append(f"event {index}: ts {event['ts']!r}")
        ph = event["ph"]
        if ph == "X":
            if not isinstance(event.get("dur"), (int, float)) or event["dur"] < 0:
                problems.append(f"event {index} ({event['name']}): dur {event.get('dur')!r}")
            else:
                spans.setdefault((event["pid"], event["tid"]), []).append((event["ts"], event["ts"] + event["dur"],
                                                                         event["name"]))
        elif ph in ("b", "e"):
            key = (event["pid"], event.get("cat"), event.get("id"))
            if event.get("id") is None or event.get("cat") is None:
                problems.append(f"event {index}: async event without id or cat")
            elif ph == "b":
                open_async[key] = open_async.get(key, 0) + 1
            elif open_async.get(key, 0) == 0:
                problems.append(f"event {index}: 'e' with no 'b' of cat {key[1]!r} id {key[2]!r}")
            else:
                open_async[key] -= 1
        elif ph == "M":
            if event["name"] not in METADATA or not isinstance(event.get("args"), dict):
                problems.append(f"event {index}: metadata {event['name']!r}")
        elif ph not in ("B", "E", "i", "I", "C", "s", "t", "f", "n"):
            problems.append(f"event {index}: phase {ph!r}")
    problems += [f"async {key} begun, never ended" for key, count in open_async.items() if count]
    for track, items in spans.items():  # complete events of one thread nest or follow, never cross (as floats)
        stack = []
        for begin, end, name in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= begin:
                stack.pop()
            if stack and end > stack[-1][1]:
                problems.append(f"{track}: {name} [{begin}, {end}] crosses {stack[-1][2]} {stack[-1][:2]}")
            stack.append((begin, end, name))
    return problems


def tracks(document) -> dict:
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out = {}
    for event in document["traceEvents"]:
        if event["ph"] == "X":
            out.setdefault(names[(event["pid"], event["tid"])], []).append(event)
    return out


def test_the_trace_keeps_the_format_rules():
    document, _ = build()
    assert chrome_trace_problems(document) == []
    assert document["displayTimeUnit"] == "ms" and document["distributedInfo"] == {"rank": 3}
    assert {e["pid"] for e in document["traceEvents"]} == {3}
    process = [e for e in document["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in process] == ["rank 3"]


def test_the_schema_check_catches_what_garbles_a_viewer():
    bad = {"traceEvents": [
        {"ph": "X", "ts": 0, "pid": 0, "tid": 0, "name": "a", "dur": -1},
        {"ph": "X", "ts": 0, "pid": 0, "tid": 1, "name": "b", "dur": 5},
        {"ph": "X", "ts": 3, "pid": 0, "tid": 1, "name": "c", "dur": 5},
        {"ph": "b", "ts": 0, "pid": 0, "tid": 0, "name": "d", "cat": "x", "id": 1},
        {"ph": "e", "ts": 1, "pid": 0, "tid": 0, "name": "d", "cat": "y", "id": 1},
        {"ph": "X", "pid": 0, "tid": 0, "name": "no ts", "dur": 1}]}
    problems = chrome_trace_problems(bad)
    assert any("dur -1" in p for p in problems)
    assert any("crosses b" in p for p in problems)
    assert any("'e' with no 'b'" in p for p in problems) and any("never ended" in p for p in problems)
    assert any("lacks ['ts']" in p for p in problems)


def test_every_collective_runs_on_its_groups_track_from_issue_to_done():
    document, records = build()
    by_track = tracks(document)
    assert set(by_track) == {"compute", "waits #2", "comm tp", "comm tp #2", "comm cp", "comm world"}
    collectives = [(name, e) for name, events in by_track.items() for e in events if e["cat"] == "coc_collective"]
    assert len(collectives) == len(records)
    for record in records:
        found = [(name, e) for name, e in collectives if e["args"]["op"] == record.op and e["args"]["wing"] == record.wing
                 and e["ts"] == pytest.approx((record.issued - BEGIN) * 1e6)]
        assert len(found) == 1, record.op
        name, event = found[0]
        assert name.split(" #")[0] == f"comm {record.group}" and event["name"] == f"{record.group} {record.op}"
        assert event["ts"] + event["dur"] == pytest.approx((record.finished - BEGIN) * 1e6)
        assert event["args"]["bytes"] == record.bytes and event["args"]["exposed_ms"] == pytest.approx(record.exposed * 1e3)
    # the second all-reduce was issued while the first was in flight: its own slot, not a garbled overlap
    assert [e["ts"] for e in by_track["comm tp #2"]] == [pytest.approx(1500.0)]
    assert sorted(e["ts"] for e in by_track["comm tp"]) == [pytest.approx(1000.0), pytest.approx(6000.0)]
    cp = by_track["comm cp"][0]["args"]
    assert cp["layer"] == "decoder.layers.0.self_attention" and cp["phase"] == "backward"
    assert by_track["comm tp #2"][0]["args"]["communication_ms"] == pytest.approx(1.0)  # queued behind the first


def test_waits_lie_inside_the_step_and_compute_fills_the_rest():
    document, records = build()
    by_track = tracks(document)
    step = [e for e in by_track["compute"] if e["cat"] == "coc_step"]
    assert [e["name"] for e in step] == ["ProfilerStep#1"] and step[0]["ts"] == 0
    assert step[0]["dur"] == pytest.approx(10000.0)
    waits = [e for events in by_track.values() for e in events if e["cat"] == "coc_wait"]
    assert len(waits) == sum(len(r.waits) for r in records)
    for event in waits:
        assert 0 <= event["ts"] and event["ts"] + event["dur"] <= step[0]["dur"] + 1e-6
        assert event["name"].startswith("wait ") and set(event["args"]) >= {"wing", "op", "group", "bytes", "layer",
                                                                            "phase", "exposed_ms"}
    overlapping = by_track["waits #2"]
    assert [(e["name"], e["args"]["copy"]) for e in overlapping] == [("wait tp all_gather", 1)]
    assert overlapping[0]["args"]["exposed_ms"] == pytest.approx(0.7)
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in by_track["compute"] if e["cat"] == "coc_compute")
    expected = [(0, 3000), (4000, 4500), (5000, 7500), (8500, 9000), (9500, 10000)]  # the step less the waits' union
    assert compute == [(pytest.approx(b), pytest.approx(e)) for b, e in expected]


def test_spans_never_cross_as_a_reader_adds_them_up():
    # a real job's clock: odd times far from zero, where ts + dur in floats may land past the next span's ts
    import random

    generator = random.Random(36)
    begin = 12345.678901234567
    records, at = [], begin
    for index in range(200):
        issued = at + generator.uniform(1e-6, 3e-4)
        wait_begin = issued + generator.uniform(0, 3e-4)
        wait_end = wait_begin + generator.uniform(1e-7, 2e-4)
        record = Collective("linears", "all_gather", "tp", 64, None, "forward", issued)
        record.waits, record.done = [(wait_begin, wait_end)], wait_end
        records.append(record)
        at = wait_end
    document = json.loads(json.dumps(trace.document(0, 2, begin, at + 1e-3, records, communication_times(records), {})))
    assert chrome_trace_problems(document) == []


def test_a_step_without_collectives_is_all_compute():
    document, _ = build([])
    assert chrome_trace_problems(document) == []
    assert [(e["name"], e["dur"]) for e in tracks(document)["compute"]] == [("ProfilerStep#1", pytest.approx(1e4)),
                                                                           ("compute", pytest.approx(1e4))]


def test_write_makes_the_directory_and_names_the_file_by_rank_and_step(tmp_path):
    records = step_records()
    path = trace.write(tmp_path / "a" / "b", 1, 7, BEGIN, END, records, communication_times(records), LAYERS)
    assert path == str(tmp_path / "a" / "b" / "step7" / "coc-trace-rank1-step7.json")
    document = json.loads(open(path, encoding="utf-8").read())
    assert chrome_trace_problems(document) == [] and document["otherData"]["step"] == 7


def test_an_unwritable_directory_is_said_once_and_the_job_runs_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    trace.log.logger.addHandler(handler)
    try:
        for step in (2, 3):
            assert trace.write(blocker / "traces", 0, step, BEGIN, END, [], [], {}) is None
    finally:
        trace.log.logger.removeHandler(handler)
    warnings = [r.getMessage() for r in seen if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"COC_TRACE={blocker / 'traces'}" in warnings[0] and "runs on" in warnings[0]


def test_an_unwritable_directory_is_said_when_the_meter_is_installed(tmp_path):
    """#43 item 5: before the first traced step (at the meter's install) and in the report."""
    from coc_inject import job
    from coc_inject.config import CocConfig
    from coc_inject.measure import install

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert trace.unwritable(tmp_path / "fine") is None and list((tmp_path / "fine").iterdir()) == []
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    trace.log.logger.addHandler(handler)
    try:
        exposure = install.install(CocConfig(trace_dir=str(blocker / "traces"), trace_steps=(2, 2)))
        said = [r.getMessage() for r in seen if r.levelno == logging.WARNING]
        assert len(said) == 1 and "cannot write traces there" in said[0] and str(blocker / "traces") in said[0]
        assert exposure.report()["trace_warnings"] == said
    finally:
        trace.log.logger.removeHandler(handler)
        job.uninstall()


def test_trace_steps_past_the_jobs_end_are_said_at_its_end(tmp_path):
    from coc_inject.config import CocConfig
    from coc_inject.measure.exposure import Exposure

    exposure = Exposure(CocConfig(trace_dir=str(tmp_path), trace_steps=(5, 6)))
    for _ in range(3):
        exposure.end_step()
    exposure.finish()
    (line,) = exposure.report()["trace_warnings"]
    assert line.startswith("COC_TRACE_STEPS=5-6: the job ended after step 3, before the first traced step")


def test_holistic_trace_analysis_loads_every_rank_of_every_traced_step(tmp_path):
    """#43 item 6: HTA's loader (holistictraceanalysis, a test dependency: Makefile's HTA_PACKAGES) reads
    each traced step's folder as one distributed step, every rank in it, the step named as torch.profiler
    counts it; a directory with two traced steps no longer mixes them."""
    hta = pytest.importorskip("hta.trace_analysis", reason="holistictraceanalysis is not installed (make test installs it)")
    for step in (2, 3):
        for rank in (0, 1):
            records = step_records()
            trace.write(tmp_path, rank, step, BEGIN, END, records, communication_times(records), LAYERS)
    for step in (2, 3):
        loaded = hta.TraceAnalysis(trace_dir=str(tmp_path / f"step{step}")).t
        assert sorted(loaded.traces) == [0, 1]
        names = loaded.symbol_table.sym_index
        assert f"ProfilerStep#{step - 1}" in names and f"ProfilerStep#{step}" not in names
        for rank in (0, 1):
            frame = loaded.get_trace(rank)
            assert len(frame) > 0 and (frame["dur"] >= 0).all()
