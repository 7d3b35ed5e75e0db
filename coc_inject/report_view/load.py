"""What ``coc-inject report`` is given, read: COC_REPORT files, trace files, COC_TRACE directories.

Every problem ends the command with one line naming the file, what was found and what is expected.
"""

from __future__ import annotations

import json
import os
import re

TRACE_FILE = re.compile(r"coc-trace-rank(\d+)-step(\d+)\.json$")
STEP_FOLDER = re.compile(r"step\d+")  # COC_TRACE's folder of one step's traces
NO_MEASURE = "the job ran without COC_MEASURE (or COC_TRACE); run it with COC_MEASURE=1 to measure"


class Input:
    """One path given: ``kind`` is "report", "trace" (a trace file) or "traces" (a directory)."""

    def __init__(self, path: str, kind: str, data=None, files=()):
        self.path, self.kind, self.data, self.files = path, kind, data, list(files)


def fail(message: str):
    raise SystemExit(f"coc-inject report: {message}")


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        fail(f"cannot read {path}: {error}")


def read(path: str) -> Input:
    if os.path.isdir(path):  # a COC_TRACE directory (its step<S>/ folders) or one step's folder
        folders = [path] + sorted(os.path.join(path, name) for name in os.listdir(path)
                                  if STEP_FOLDER.fullmatch(name) and os.path.isdir(os.path.join(path, name)))
        files = sorted(os.path.join(folder, name) for folder in folders for name in os.listdir(folder)
                       if TRACE_FILE.search(name))
        if not files:
            fail(f"{path} is a directory without trace files (step<S>/coc-trace-rank<R>-step<S>.json, as COC_TRACE "
                 "writes them)")
        return Input(path, "traces", files=files)
    data = read_json(path)
    if isinstance(data, dict) and "traceEvents" in data:
        return Input(path, "trace", data, files=[path])
    if isinstance(data, dict) and ("layers" in data or "communication" in data):
        return Input(path, "report", data)
    found = f"an object with keys {', '.join(sorted(data)[:6])}" if isinstance(data, dict) else type(data).__name__
    fail(f"{path} is neither a COC_REPORT file (keys 'layers', 'communication') nor a COC_TRACE trace "
         f"('traceEvents'): found {found}")


def communication(path: str, report: dict) -> dict:
    """The report's ``communication`` section with at least one measured step; else the command ends
    naming the file and what is missing."""
    if "communication" not in report:
        fail(f"{path}: no 'communication' section (a report from a coc-inject without COC_MEASURE, or not a "
             f"COC_REPORT file); {NO_MEASURE}")
    section = report["communication"]
    if section is None:
        fail(f"{path}: 'communication' is null: {NO_MEASURE}")
    if not isinstance(section, dict) or section.get("total") is None:
        fail(f"{path}: 'communication' has no measured step ('total' is missing or null): the job ended before "
             "the first measured step's optimizer step, or COC_MEASURE's steps never ran")
    return section


def has_communication(report: dict) -> bool:
    section = report.get("communication")
    return isinstance(section, dict) and section.get("total") is not None


def trace_files_of(item: Input) -> list:
    """The trace files an input stands for: its own, a directory's, or those a report lists (found as
    written, else beside the report)."""
    if item.kind != "report":
        return item.files
    section = item.data.get("communication") or {}
    found = []
    for path in section.get("traces") or []:
        beside = os.path.join(os.path.dirname(item.path), os.path.basename(path))
        if os.path.exists(path) or os.path.exists(beside):
            found.append(path if os.path.exists(path) else beside)
    if not found:
        fail(f"{item.path}: no trace file to plot (its communication.traces is "
             f"{section.get('traces') or 'empty'}; the job needs COC_TRACE=DIR, and the files must still exist)")
    return found


def trace(path: str) -> dict:
    """A trace file: {rank, step, step_ms, tracks: {name: [(begin_ms, end_ms, name, cat)]}} in the
    tracks' order."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        fail(f"{path}: not a Chrome trace (no 'traceEvents' list)")
    match = TRACE_FILE.search(os.path.basename(path))
    other = data.get("otherData") or {}
    rank = other.get("rank", data.get("distributedInfo", {}).get("rank", int(match.group(1)) if match else 0))
    step = other.get("step", int(match.group(2)) if match else None)
    names, order, tracks = {}, {}, {}
    for event in data["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[event["tid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_sort_index":
            order[event["tid"]] = event["args"]["sort_index"]
    for event in data["traceEvents"]:
        if event.get("ph") == "X":
            track = names.get(event["tid"], f"thread {event['tid']}")
            tracks.setdefault((order.get(event["tid"], event["tid"]), track), []).append(
                (event["ts"] / 1e3, (event["ts"] + event.get("dur", 0)) / 1e3, event["name"], event.get("cat", "")))
    step_ms = other.get("step_ms") or max((end for spans in tracks.values() for _, end, _, _ in spans), default=0.0)
    return {"path": path, "rank": rank, "step": step, "step_ms": step_ms,
            "tracks": {name: spans for (_, name), spans in sorted(tracks.items())}}
