"""One record per collective, and the sums the summary, the report and ``coc-inject report`` show.

Times are seconds on one clock per rank (the host's, or the device's events resolved onto it):
``issued`` when the call was made, ``waits`` the spans the rank waited for it (a synchronous call:
the call itself), ``done`` when the network finished it where the backend says so (gloo's future),
else the end of its last wait. Its **communication** time is ``done`` less the later of ``issued``
and the previous collective's ``done`` on the same group (collectives on one group queue behind each
other, so a chunk issued while the previous one is in flight is not charged that one's time); its
**exposed** time is the sum of its waits less the part spent waiting for slower ranks (its **peers**
time, peers.py: on the host clock), which its communication loses too; **hidden** is what of the
communication the rank did not wait for.
"""

from __future__ import annotations

NO_GROUP = object()  # a record made without its process group (peers.py leaves it out)


class Collective:
    """One collective call: who issued it and when it went out, was waited for and finished."""

    __slots__ = ("wing", "op", "group", "bytes", "layer", "phase", "issued", "waits", "done", "marks", "copy",
                 "handle", "skew")

    def __init__(self, wing, op, group, nbytes, layer, phase, issued, copy=None, handle=NO_GROUP):
        self.wing, self.op, self.group, self.bytes = wing, op, group, nbytes
        self.layer, self.phase, self.issued, self.copy = layer, phase, issued, copy
        self.waits: list = []  # [(begin, end)]
        self.done = None
        self.marks = None  # device events not yet resolved (clocks.DeviceClock)
        self.handle = handle  # the process group object (None: the world; NO_GROUP: unknown), for peers.py
        self.skew = 0.0  # how much longer than the group's fastest rank it was in flight (peers.py)

    @property
    def waited(self) -> float:
        """Every wait, the peers' part included."""
        return sum(end - begin for begin, end in self.waits)

    @property
    def peers(self) -> float:
        """Of the waits, the time spent waiting for slower ranks (peers.py), not for the link."""
        return min(self.waited, self.skew)

    @property
    def exposed(self) -> float:
        """The waits less the time spent waiting for slower ranks."""
        return self.waited - self.peers

    @property
    def finished(self) -> float:
        """``done`` where the backend said so (a wait after it, however late, does not stretch the
        communication), else the end of the last wait."""
        if self.done is not None:
            return self.done
        return max((end for _, end in self.waits), default=self.issued)


def communication_times(collectives) -> list:
    """Each collective's time on the network: from the later of its issue and the previous ``done`` of
    its group to its own ``done`` (at least its exposed time)."""
    previous: dict = {}
    times = [0.0] * len(collectives)
    for index in sorted(range(len(collectives)), key=lambda i: collectives[i].finished):
        record = collectives[index]
        start = max(record.issued, previous.get(record.group, record.issued))
        times[index] = max(record.finished - start - record.skew, record.exposed)
        previous[record.group] = record.finished
    return times


def _add(into: dict, key, record: Collective, communication: float) -> None:
    row = into.setdefault(key, {"collectives": 0, "bytes": 0, "communication_s": 0.0, "exposed_s": 0.0,
                                "peers_s": 0.0})
    row["collectives"] += 1
    row["bytes"] += record.bytes
    row["communication_s"] += communication
    row["exposed_s"] += record.exposed
    row["peers_s"] += record.peers


def _finish(rows: dict) -> dict:
    for row in rows.values():
        row["hidden_s"] = max(0.0, row["communication_s"] - row["exposed_s"])
        row["hidden_pct"] = 100.0 * row["hidden_s"] / row["communication_s"] if row["communication_s"] > 0 else 0.0
    return rows


def kind(record: Collective) -> str:
    """A collective's kind as the side-by-side compares it: the group and the operation ("tp all_reduce")."""
    return f"{record.group} {record.op}"


def summarize(collectives, seconds: float | None = None) -> dict:
    """The sums of one step: per wing, per kind of collective, per (layer id, phase, wing)."""
    times = communication_times(collectives)
    wings, kinds, layers = {}, {}, {}
    for record, communication in zip(collectives, times):
        _add(wings, record.wing, record, communication)
        _add(kinds, kind(record), record, communication)
        _add(layers, (record.layer, record.phase, record.wing), record, communication)
    total = {"all": {"collectives": 0, "bytes": 0, "communication_s": 0.0, "exposed_s": 0.0, "peers_s": 0.0}}
    for record, communication in zip(collectives, times):
        _add(total, "all", record, communication)
    return {"step_s": seconds, "total": _finish(total)["all"],
            "wings": _finish(wings), "collectives": _finish(kinds), "layers": _finish(layers)}


def merged(summaries: list) -> dict:
    """Several steps' sums added up (their step times too)."""
    out = {"step_s": 0.0, "steps": sum(summary.get("steps", 1) for summary in summaries), "total": {"collectives": 0, "bytes": 0, "communication_s": 0.0,
                                                          "exposed_s": 0.0, "peers_s": 0.0}, "wings": {}, "collectives": {}, "layers": {}}
    for summary in summaries:
        out["step_s"] += summary.get("step_s") or 0.0
        for part in ("wings", "collectives", "layers"):
            for key, row in summary[part].items():
                _sum_into(out[part].setdefault(key, {}), row)
        _sum_into(out["total"], summary["total"])
    for part in ("wings", "collectives", "layers"):
        _finish(out[part])
    _finish({"all": out["total"]})
    return out


def _sum_into(into: dict, row: dict) -> None:
    for field in ("collectives", "bytes", "communication_s", "exposed_s", "peers_s"):
        into[field] = into.get(field, 0) + row.get(field, 0)


def step_runs(steps: list) -> str:
    """Step numbers as runs: [2, 3, 5, 6, 7] -> "2-3, 5-7"."""
    runs: list = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def step_range(steps: tuple) -> str:
    """A ``(first, last)`` range as the settings write it: "2-5", "3", "2-" (no last)."""
    first, last = steps
    return f"{first}-" if last is None else str(first) if first == last else f"{first}-{last}"
