"""COC_TRACE: one measured step of one rank as a Chrome-trace JSON (Perfetto, chrome://tracing).

One directory per traced step, ``step<S>/`` (every rank's file of that step: the directory a trace
tool loads as one distributed step), one file per rank, ``coc-trace-rank<R>-step<S>.json``, process
``rank R`` (pid = rank), times in microseconds from the step's begin (``displayTimeUnit`` ms;
``baseTimeNanoseconds`` the step's begin on the host clock). Tracks (threads):

* ``compute``: the step (``ProfilerStep#<S-1>``, as torch.profiler counts a job's steps from 0) and inside it what
  the rank did not wait for (``compute``) between the waits, each wait a span named for its
  collective (``wait tp all_reduce``, args: wing, op, group, bytes, layer, phase, exposed_ms).
  Waits that overlap each other (copies' threads) go to ``waits #2``, ``#3``, ...;
* ``comm <group>``: each collective in flight, issue to done (``tp all_reduce``); one that starts
  while another of its group is still in flight goes to ``comm <group> #2`` and on, so that complete
  events of one track never overlap (the viewers garble overlapping ones).

``distributedInfo.rank`` is set, so Holistic Trace Analysis can load the files (docs/measuring.md
says what it can and cannot read in them). A directory that cannot be written is said once; the
job runs on without its trace.
"""

from __future__ import annotations

import json
import logging
import os

from coc_inject import __version__, log
from coc_inject.measure.records import kind

COMPUTE = "compute"


def file_name(rank: int, step: int) -> str:
    return f"coc-trace-rank{rank}-step{step}.json"


def step_directory(step: int) -> str:
    return f"step{step}"


def _lanes(spans: list) -> list:
    """Each ``(begin, end)`` span's lane: the first whose spans all ended by its begin."""
    ends, lanes = [], [0] * len(spans)
    for index in sorted(range(len(spans)), key=lambda i: spans[i]):
        begin, end = spans[index]
        lane = next((n for n, last in enumerate(ends) if last <= begin), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        lanes[index] = lane
    return lanes


def _uncovered(begin: float, end: float, spans: list) -> list:
    """``[begin, end]`` less the union of ``spans``."""
    out, at = [], begin
    for b, e in sorted(spans):
        if b > at:
            out.append((at, b))
        at = max(at, e)
    if at < end:
        out.append((at, end))
    return out


def events(rank, step, begin, end, collectives, communication_times, layer_names) -> list:
    """The trace's events (see the module's doc) of one step of one rank."""
    def us(t):
        return round((t - begin) * 1e6, 3)

    out = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "ts": 0, "args": {"name": f"rank {rank}"}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "ts": 0, "args": {"sort_index": rank}}]
    tids: dict = {}

    def tid(track: str) -> int:
        if track not in tids:
            tids[track] = len(tids)
            out.extend({"ph": "M", "name": meta, "pid": rank, "tid": tids[track], "ts": 0, "args": args}
                       for meta, args in (("thread_name", {"name": track}), ("thread_sort_index",
                                                                            {"sort_index": tids[track]})))
        return tids[track]

    def span(track, name, cat, b, e, args=None):
        ts, stop = us(b), us(e)
        dur = max(0.0, round(stop - ts, 3))
        if ts + dur > stop:  # a reader's float sum past the next span's ts would cross it: 1 ns shorter
            dur = max(0.0, round(dur - 0.001, 3))
        event = {"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid(track), "ts": ts, "dur": dur}
        if args:
            event["args"] = args
        out.append(event)

    def described(record):
        layer = layer_names.get(record.layer, "(no layer)") if record.layer is not None else "(no layer)"
        found = {"wing": record.wing, "op": record.op, "group": record.group, "bytes": record.bytes,
                 "layer": layer, "phase": record.phase}
        return found if record.copy is None else dict(found, copy=record.copy)

    span(COMPUTE, f"ProfilerStep#{step - 1}", "coc_step", begin, end, {"step": step, "collectives": len(collectives)})
    waits = [(record, max(begin, min(b, end)), max(begin, min(e, end))) for record in collectives
             for b, e in record.waits]
    for b, e in _uncovered(begin, end, [(b, e) for _, b, e in waits]):
        span(COMPUTE, COMPUTE, "coc_compute", b, e)
    for (record, b, e), lane in zip(waits, _lanes([(b, e) for _, b, e in waits])):
        span(COMPUTE if lane == 0 else f"waits #{lane + 1}", f"wait {kind(record)}", "coc_wait", b, e,
             dict(described(record), exposed_ms=round((e - b) * 1e3, 6)))
    by_group: dict = {}
    for record, communication in zip(collectives, communication_times):
        by_group.setdefault(record.group, []).append((record, communication))
    for group, rows in by_group.items():
        lanes = _lanes([(record.issued, record.finished) for record, _ in rows])
        for (record, communication), lane in zip(rows, lanes):
            span(f"comm {group}" + ("" if lane == 0 else f" #{lane + 1}"), kind(record), "coc_collective",
                 record.issued, record.finished, dict(described(record), communication_ms=round(communication * 1e3, 6),
                                                      exposed_ms=round(record.exposed * 1e3, 6)))
    return out


def _distributed(rank: int) -> dict:
    """kineto's ``distributedInfo`` (what HTA reads): the rank, and the world where there is one."""
    import torch.distributed as dist

    info = {"rank": rank}
    if dist.is_available() and dist.is_initialized():
        info.update(world_size=dist.get_world_size(), backend=str(dist.get_backend()))
    return info


def document(rank, step, begin, end, collectives, communication_times, layer_names) -> dict:
    return {"traceEvents": events(rank, step, begin, end, collectives, communication_times, layer_names),
            "displayTimeUnit": "ms", "baseTimeNanoseconds": int(begin * 1e9), "distributedInfo": _distributed(rank),
            "otherData": {"producer": f"coc-inject {__version__}", "rank": rank, "step": step,
                          "step_ms": round((end - begin) * 1e3, 6), "times": "microseconds from the step's begin"}}


def unwritable(directory) -> str | None:
    """Why traces cannot be written into ``directory`` (made if missing), or None: checked when the meter
    is installed, so that the job and ``coc-inject status`` say it before the first traced step."""
    probe = os.path.join(str(directory), f".coc-trace-probe-{os.getpid()}")
    try:
        os.makedirs(str(directory), exist_ok=True)
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as error:
        return f"COC_TRACE={directory}: cannot write traces there ({error.strerror or error}); the job runs on without them"
    return None


def write(directory, rank, step, begin, end, collectives, communication_times, layer_names):
    """Writes one step's trace into ``directory`` (made if missing); its path, or None (said once)
    where the directory cannot be written."""
    folder = os.path.join(str(directory), step_directory(step))
    path = os.path.join(folder, file_name(rank, step))
    try:
        os.makedirs(folder, exist_ok=True)
        content = json.dumps(document(rank, step, begin, end, collectives, communication_times, layer_names))
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(content)
    except OSError as error:
        log.once(("COC_TRACE", str(directory)), logging.WARNING,
                 f"COC_TRACE={directory}: cannot write the trace there ({error}); the job runs on without it")
        return None
    return path
