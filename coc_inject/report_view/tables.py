"""The communication table of a COC_REPORT file, and the side-by-side of two (off and on): text and JSON.

Figures are per step, averaged over the report's **steady** steps (``communication.steady``: the
measured steps after the first, without auto's trials; its sums divided by its ``steps``), or over
every measured step where the report has no steady one (a one-step run, an older report: said so);
the first measured step's time is given beside them (it runs auto's trials). A row: collectives and bytes per step, communication issued (ms: in flight on the network,
records.communication_times), exposed (ms: waited for), hidden (% of the issued not waited for).
"""

from __future__ import annotations

from coc_inject.measure import records
from coc_inject.report_view import load

TOP_LAYERS = 10


def per_step(row: dict, steps: int) -> dict:
    """A summary row (seconds, sums over ``steps`` steps) as per-step figures in milliseconds."""
    communication, exposed = row.get("communication_s", 0.0), row.get("exposed_s", 0.0)
    hidden = max(0.0, communication - exposed)
    return {"collectives": row.get("collectives", 0) / steps, "bytes": row.get("bytes", 0) / steps,
            "communication_ms": 1e3 * communication / steps, "exposed_ms": 1e3 * exposed / steps,
            "hidden_ms": 1e3 * hidden / steps, "hidden_pct": 100.0 * hidden / communication if communication > 0 else 0.0,
            "peers_ms": 1e3 * row.get("peers_s", 0.0) / steps}


def _by_exposed(rows: dict) -> list:
    return sorted(rows.items(), key=lambda item: (-item[1]["exposed_ms"], -item[1]["communication_ms"], item[0]))


def communication(path: str, report: dict, top: int = TOP_LAYERS) -> dict:
    """One report's communication figures (the JSON twin of :func:`communication_text`)."""
    section = load.communication(path, report)
    steady = section.get("steady")
    total = steady or section["total"]
    steps = max(1, int(total.get("steps", 1)))
    if steady:
        covered = _steps_text(section.get("steady_steps") or [], "steady step")
    else:
        seen = [row.get("step") for row in section.get("per_step") or [] if row.get("step") is not None]
        covered = _steps_text(seen, "measured step", steps) + " (none steady)"
    first = section.get("first_step") or {}
    rows = {part: {key: per_step(row, steps) for key, row in total.get(part, {}).items()}
            for part in ("wings", "collectives", "layers")}
    return {"path": path, "rank": report.get("rank"), "world_size": report.get("world_size"),
            "clock": section.get("clock"), "steps": steps, "measured_steps": section.get("measured_steps"),
            "covered": covered, "trial_steps": list(section.get("trial_steps") or []),
            "step_ms": 1e3 * (total.get("step_s") or 0.0) / steps,
            "first_step": {"step": first.get("step"), "step_ms": 1e3 * (first.get("step_s") or 0.0)},
            "total": per_step(total["total"], steps), "wings": dict(_by_exposed(rows["wings"])),
            "collectives": dict(_by_exposed(rows["collectives"])),
            "layers": [dict(row, layer=name) for name, row in _by_exposed(rows["layers"])[:top]],
            "layers_shown": min(top, len(rows["layers"])), "layers_total": len(rows["layers"]),
            "warnings": list(section.get("warnings") or []) + list(section.get("trace_warnings") or []),
            "traces": list(section.get("traces") or [])}


def _steps_text(steps: list, kind: str, count: int = 0) -> str:
    """"steady steps 2-8" / "steady steps 2, 4-8"; "3 measured steps" without the list (an older report)."""
    if not steps:
        return f"{count} {kind}{'s' if count != 1 else ''}"
    return f"{kind}{'s' if len(steps) != 1 else ''} {records.step_runs(steps)}"


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _table(rows: list) -> list:
    """``[(label, row)]`` as aligned lines: issued ms, exposed ms, hidden %, collectives, MB."""
    head = ("", "issued ms", "exposed ms", "hidden", "collectives", "MB")
    cells = [head] + [(label, f"{row['communication_ms']:.2f}", f"{row['exposed_ms']:.2f}",
                       f"{row['hidden_pct']:.0f}%", _count(row["collectives"]), f"{row['bytes'] / 1e6:.2f}")
                      for label, row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(head))]
    return ["    " + cells_line[0].ljust(widths[0]) + "".join("  " + cell.rjust(w) for cell, w in
                                                           zip(cells_line[1:], widths[1:]))
            for cells_line in cells]


def communication_text(figures: dict) -> str:
    first = figures["first_step"]
    lines = [f"{figures['path']}: communication of rank {figures['rank']}/{figures['world_size']}, "
             f"{figures['clock']} clock, per step over {figures['covered']}: step {figures['step_ms']:.1f} ms"
             + (f" (first measured step {first['step']}: {first['step_ms']:.1f} ms)" if first["step"] else "")]
    lines.append("  per wing")
    lines += _table(list(figures["wings"].items()) + [("all", figures["total"])])
    if figures["total"]["peers_ms"] >= 0.05:
        lines.append(f"  waiting for slower ranks: {figures['total']['peers_ms']:.2f} ms per step (host clock; not in "
                     "any row's exposed ms)")
    lines.append("  per collective (group and operation)")
    lines += _table(list(figures["collectives"].items()))
    lines.append(f"  layers (top {figures['layers_shown']} of {figures['layers_total']} by exposed ms; "
                 "layer | phase | wing)")
    lines += _table([(row["layer"], row) for row in figures["layers"]])
    lines += [f"  warning: {line}" for line in figures["warnings"]]
    lines += [f"  trace: {path}" for path in figures["traces"]]
    return "\n".join(lines)


def _pair(off_rows: dict, on_rows: dict) -> dict:
    keys = sorted(set(off_rows) | set(on_rows),
                  key=lambda k: (-max((off_rows.get(k) or {}).get("exposed_ms", 0.0),
                                      (on_rows.get(k) or {}).get("exposed_ms", 0.0)), k))
    return {key: {"off": off_rows.get(key), "on": on_rows.get(key)} for key in keys}


def _ratio(before: float, after: float):
    return before / after if after > 0 else None


def side_by_side(off: tuple, on: tuple) -> dict:
    """``off`` and ``on``: (path, report). Per collective kind, per wing and in all: both sides' rows."""
    a, b = communication(*off, top=0), communication(*on, top=0)
    return {"off": {"path": a["path"], "rank": a["rank"], "steps": a["steps"], "clock": a["clock"],
                    "covered": a["covered"]},
            "on": {"path": b["path"], "rank": b["rank"], "steps": b["steps"], "clock": b["clock"],
                   "covered": b["covered"]},
            "step": {"first_ms": {"off": a["first_step"]["step_ms"], "on": b["first_step"]["step_ms"],
                                  "speedup": _ratio(a["first_step"]["step_ms"], b["first_step"]["step_ms"])},
                     "measured_ms": {"off": a["step_ms"], "on": b["step_ms"], "speedup": _ratio(a["step_ms"],
                                                                                                 b["step_ms"])}},
            "collectives": _pair(a["collectives"], b["collectives"]), "wings": _pair(a["wings"], b["wings"]),
            "total": {"off": a["total"], "on": b["total"]}}


def _change(label: str, pair: dict) -> str:
    off, on = pair["off"], pair["on"]

    def side(row, field, unit):
        return "-" if row is None else f"{row[field]:.1f}{unit}"

    return (f"  {label}: {side(off, 'exposed_ms', ' ms')} exposed -> {side(on, 'exposed_ms', ' ms')} "
            f"(issued {side(off, 'communication_ms', '')} -> {side(on, 'communication_ms', ' ms')}; "
            f"hidden {side(off, 'hidden_pct', '%')} -> {side(on, 'hidden_pct', '%')})")


def side_by_side_text(figures: dict) -> str:
    off, on, step = figures["off"], figures["on"], figures["step"]

    def times(name, unit):
        pair = step[name]
        faster = f" (off/on {pair['speedup']:.3f}x)" if pair["speedup"] else ""
        return f"{pair['off']:.1f} -> {pair['on']:.1f} ms{unit}{faster}"

    lines = [f"off {off['path']} (rank {off['rank']}, {off['covered']}) -> on {on['path']} "
             f"(rank {on['rank']}, {on['covered']}); per step, averaged over those steps (the first measured step "
             "and steps with auto's trials left out where the report has others)",
             f"  step: first measured step {times('first_ms', '')}; averaged {times('measured_ms', ' per step')}"]
    if off["clock"] != on["clock"]:
        lines.append(f"  note: the clocks differ ({off['clock']} -> {on['clock']}): the figures are not alike")
    lines.append("  per collective (group and operation):")
    lines += ["  " + _change(kind, pair) for kind, pair in figures["collectives"].items()]
    lines.append("  per wing:")
    lines += ["  " + _change(wing, pair) for wing, pair in figures["wings"].items()]
    lines.append(_change("all communication", figures["total"]))
    peers = figures["total"]
    if max(row["peers_ms"] if row else 0.0 for row in peers.values()) >= 0.05:
        lines.append(f"  waiting for slower ranks: {peers['off']['peers_ms']:.1f} ms -> {peers['on']['peers_ms']:.1f} ms "
                     "per step (not in the exposed figures)")
    return "\n".join(lines)
