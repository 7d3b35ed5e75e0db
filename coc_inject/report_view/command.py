"""``coc-inject report PATH ... [--compare] [--json] [--plot PNG [--step S]] [--top N]``.

* COC_REPORT files (one per rank, or several ranks'): each one's per-layer route table (cli.py's, as
  before), then its communication table where the job measured (COC_MEASURE), else a line saying so.
* Two reports of the same rank, both measured, or ``--compare`` with two: the side-by-side, the first
  off and the second on.
* ``--json``: the text's JSON twin (the communication figures, or the side-by-side).
* ``--plot PNG``: one step's timeline per rank (``--step``, else each run's first traced step) from
  trace files, COC_TRACE directories, or the traces the reports list; a run per directory, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys

from coc_inject.report_view import load, plot, tables


def positive(option: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option}={text!r}: expected a positive integer")
        return value
    return parse


def png(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"--plot={text!r}: expected a file name ending in .png")
    return text


def add_arguments(parser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="COC_REPORT files (one per rank, or off and on), trace files or COC_TRACE directories")
    parser.add_argument("--compare", action="store_true",
                        help="two reports side by side, the first off and the second on (automatic for two "
                             "measured reports of the same rank)")
    parser.add_argument("--json", action="store_true", help="the communication figures (or the side-by-side) as JSON")
    parser.add_argument("--plot", type=png, metavar="PNG", help="draw one step's timeline per rank from the traces")
    parser.add_argument("--step", type=positive("--step"), help="the traced step --plot draws (default: the first)")
    parser.add_argument("--top", type=positive("--top"), default=tables.TOP_LAYERS,
                        help=f"layers listed per report (default {tables.TOP_LAYERS})")


def _compared(args, reports: list) -> bool:
    if args.compare:
        if len(reports) != 2:
            load.fail(f"--compare takes two COC_REPORT files (off, then on), got {len(reports)}: "
                      + ", ".join(item.path for item in reports))
        return True
    return (len(reports) == 2 and all(load.has_communication(item.data) for item in reports)
            and reports[0].data.get("rank") == reports[1].data.get("rank"))


def run(args, route_table) -> int:
    """The command; ``route_table([(path, report)])`` is the per-layer table (cli.report_table)."""
    inputs = [load.read(path) for path in args.paths]
    reports = [item for item in inputs if item.kind == "report"]
    traces = [item for item in inputs if item.kind != "report"]
    if traces and not args.plot:
        load.fail(f"{traces[0].path} is a trace (COC_TRACE): give --plot PNG to draw it")
    if args.step and not args.plot:
        load.fail("--step picks the step --plot draws: give --plot PNG too")
    compare = _compared(args, reports)
    if compare:
        figures = tables.side_by_side(*[(item.path, item.data) for item in reports])
        print(json.dumps(figures, indent=1) if args.json else tables.side_by_side_text(figures))
    elif reports and args.json:
        print(json.dumps({"reports": [tables.communication(item.path, item.data, args.top) for item in reports]},
                         indent=1))
    elif reports:
        blocks = []
        for item in reports:
            lines = [route_table([(item.path, item.data)])]
            if load.has_communication(item.data):
                lines.append(tables.communication_text(tables.communication(item.path, item.data, args.top)))
            else:
                lines.append(f"{item.path}: no communication figures ('communication' is "
                             f"{'null' if 'communication' in item.data else 'missing'}): {load.NO_MEASURE}")
            blocks.append("\n\n".join(lines))
        print("\n\n".join(blocks))
    if args.plot:
        files = [path for item in (traces or reports) for path in load.trace_files_of(item)]
        drawn, problem = plot.write(args.plot, files, args.step)
        if problem:
            print(f"coc-inject report: --plot {args.plot}: {problem}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot} ({drawn})", file=sys.stderr if args.json else sys.stdout)
    return 0
