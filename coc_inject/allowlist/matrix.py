"""The wing x setting matrix of docs/compatibility.md, made from the allow-list's rows, so that it cannot
drift from what the wings check: ``python -m coc_inject.allowlist.matrix`` prints it (a test holds the page
to this output).

One line per setting that some wing does not take with any value (a refusal, or support of some values
only); the settings every wing takes whatever their value (or never reads) are counted, not listed.
A cell: ``✓`` any value, ``~`` some values (the others step aside with the reason), ``✗`` refused when
on (the layer, block or call runs Megatron's path with the reason; context parallelism at CP > 1,
which Megatron's local attention cannot run at all, stops with it), ``·`` not read by the wing.
"""

from __future__ import annotations

from coc_inject.allowlist.check import WINGS
from coc_inject.allowlist.rows import IRRELEVANT, REFUSED, SUPPORTED

COLUMNS = ("linears", "context_parallel", "multi_copy", "sequence_copies", "moe")
HEADS = ("linears", "CP attention", "batch copies", "sequence copies", "MoE pieces")


def cell(row) -> str:
    if row is None or row.verdict == IRRELEVANT:
        return "·"
    if row.verdict == SUPPORTED:
        return "✓" if row.allows is None else "~"
    return "~" if row.verdict == REFUSED and callable(row.allows) else "✗"


def _notable(name: str) -> bool:
    return any(cell(WINGS[wing].rows.get(name)) in ("~", "✗") for wing in COLUMNS)


def _reason(name: str) -> str:
    """The first refusing (or limiting) wing's reason, shortened to one clause."""
    for wing in COLUMNS:
        row = WINGS[wing].rows.get(name)
        if cell(row) in ("~", "✗"):
            why = row.why.split(";")[0].split(":")[0]
            return why if len(why) <= 90 else why[:87] + "..."
    return ""


def markdown() -> str:
    names = sorted({name for wing in COLUMNS for name in WINGS[wing].rows})
    notable = [name for name in names if _notable(name)]
    lines = [f"| setting | {' | '.join(HEADS)} | why (the first wing that limits it) |",
             "|---|" + "---|" * len(HEADS) + "---|"]
    for name in notable:
        cells = " | ".join(cell(WINGS[wing].rows.get(name)) for wing in COLUMNS)
        lines.append(f"| `{name}` | {cells} | {_reason(name)} |")
    lines.append("")
    lines.append(f"{len(names) - len(notable)} more settings are classified and taken with any value (or never read) "
                 "by every wing: `python -m coc_inject.allowlist.matrix` lists only the ones above.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
