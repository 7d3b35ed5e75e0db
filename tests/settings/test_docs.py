"""The front door stays true: docs/settings.md is `coc-inject reference`'s output, and every file,
link, `make` target and `coc-inject` command that README.md and docs/ name exists."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/dev/ too
GENERATED_FROM = "| variable |"  # docs/settings.md: from this line to the end, the command's output


def test_settings_page_is_the_reference_command_output():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in [name for name in env if name.startswith(("COC_", "USE_COC_"))]:
        del env[name]
    output = subprocess.run([sys.executable, "-m", "coc_inject", "reference"], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=True).stdout
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page.count("\n" + GENERATED_FROM) == 1, "docs/settings.md: one generated block"
    generated = page[page.index("\n" + GENERATED_FROM) + 1:]
    assert generated == output, (
        "docs/settings.md is stale; regenerate it: "
        "sed -i '/^| variable |/,$d' docs/settings.md && python -m coc_inject reference >> docs/settings.md")


def test_compatibility_page_is_the_allow_lists_matrix():
    """#45: docs/compatibility.md's settings table is made from the allow-list's rows (it cannot drift)."""
    from coc_inject.allowlist import matrix

    page = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    head = "| setting |"
    assert page.count("\n" + head) == 1, "docs/compatibility.md: one generated block"
    assert page[page.index("\n" + head) + 1:] == matrix.markdown(), (
        "docs/compatibility.md is stale; regenerate it: sed -i '/^| setting |/,$d' docs/compatibility.md && "
        "python -m coc_inject.allowlist.matrix >> docs/compatibility.md")


def test_every_ratio_the_pages_quote_is_in_the_results():
    """#45: one source for each figure: every speed-up the README and docs/ quote (1.187×, a range's ends)
    is a figure of benchmarks/RESULTS.md, with the same digits."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    measured = {value for figure in re.findall(r"\d+\.\d+(?:[–-]\d+\.\d+)?[×x]", results)
                for value in re.split(r"[–-]", figure.rstrip("×x"))}
    missing, quoted = [], 0
    for page in PAGES:
        for figure in re.findall(r"\d+\.\d+(?:–\d+\.\d+)?×", page.read_text(encoding="utf-8")):
            for value in figure.rstrip("×").split("–"):
                quoted += 1
                if value not in measured:
                    missing.append(f"{page.relative_to(ROOT)}: {value}")
    assert quoted, "no page quotes a ratio: the check has nothing to hold"
    assert not missing, f"ratios the pages quote that RESULTS.md does not have: {sorted(set(missing))}"


def test_relative_links_resolve():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def make_targets():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))


def test_make_targets_named_exist():
    targets = make_targets()
    named = {(page.name, target) for page in PAGES
             for target in re.findall(r"`make ([a-z][a-z0-9-]*)", page.read_text(encoding="utf-8"))}
    assert named and not {pair for pair in named if pair[1] not in targets}


def test_coc_inject_commands_named_exist():
    from coc_inject.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command_name").choices
    named = {(page.name, word) for page in PAGES
             for word in re.findall(r"`coc-inject ([a-z]+)", page.read_text(encoding="utf-8"))}
    assert named and not {pair for pair in named if pair[1] not in commands}


def test_repository_paths_named_exist():
    # Back-quoted paths under the project's own top directories (README and docs/).
    tops = ("coc_inject/", "tests/", "examples/", "benchmarks/", "env/", "sitecustomize/", "docs/", ".ci/")
    elsewhere = {"coc_inject/_site",  # sitecustomize/ as the installed package names it (pyproject.toml)
                 "docs/features/communication-over-computation.md"}  # MindSpeed's, cited by dev/fused-backends.md
    missing = []
    for page in PAGES:
        for path in re.findall(r"`([A-Za-z_./-]+)`", page.read_text(encoding="utf-8")):
            if path.startswith(tops) and path not in elsewhere and not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


LEDGER = "## Figures the pages quote"


def ledger(path: pathlib.Path, heading: str) -> list:
    """(identity (what, shape, link, device), the figure's values, commit) per row of the ledger table under
    ``heading``, in the page's order."""
    section = path.read_text(encoding="utf-8").split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0] in ("what", "---") or set(cells[0]) <= set("-"):
            continue
        values = [value for value in re.split(r"\s*(?:/|–)\s*", cells[4].replace("×", "")) if value]
        rows.append((tuple(cells[:4]), values, cells[5]))
    return rows


def quoted_ratios(page: pathlib.Path) -> set:
    return {value for figure in re.findall(r"\d+\.\d+(?:–\d+\.\d+)?×", page.read_text(encoding="utf-8"))
            for value in figure.rstrip("×").split("–")}


def test_pages_quote_the_latest_figure_of_each_identity():
    """#54: a RESULTS row has an identity (what, shape, link, device, commit); the ledger keeps the latest per
    identity, HISTORY.md the ones it superseded. A page quoting a superseded figure fails (README's 'latest
    make demo' column had 7124bef's 1.255x where a04e601 measured 1.180x)."""
    latest = ledger(ROOT / "benchmarks" / "RESULTS.md", LEDGER)
    earlier = ledger(ROOT / "benchmarks" / "HISTORY.md", LEDGER + ", superseded")
    identities = [identity for identity, _, _ in latest]
    assert latest and earlier and len(set(identities)) == len(identities), "one ledger row per identity"
    assert not {identity for identity, _, _ in earlier} - set(identities), "a superseded row without its latest"
    current = {value for _, values, _ in latest for value in values}
    by_value = {}
    for identity, values, commit in earlier:
        for value in set(values) - current:
            by_value.setdefault(value, []).append((identity, commit))
    stale = []
    for page in PAGES:
        for value in sorted(quoted_ratios(page) & set(by_value)):
            for identity, commit in by_value[value]:
                now = next(f"{'/'.join(v)}× ({c})" for i, v, c in latest if i == identity)
                stale.append(f"{page.relative_to(ROOT)}: {value}× is {commit}'s '{identity[0]}'; latest {now}")
    assert not stale, stale


STATUS = "## What ran where"
# Claims about hardware that contradict docs/compatibility.md's status (one GPU's cases, ranks sharing one GPU).
CONTRADICTIONS = [
    r"\bnothing\b[^.;|]{0,40}\b(ran|run|measured)\b[^.;|]{0,20}\bon (a|any) GPU",  # the meter's and CP's cases ran
    r"\bnothing multi-rank\b",
    r"\b(run|ran|verified)( for real)? on (the )?CPU only\b",
    r"\bonly the CPU\b[^.;|]{0,30}\b(run|ran)\b",
    r"\bverified: CPU only\b",
    r"\bonly (the )?CPU( \+ gloo)? ran\b",
    r"\(not run on a GPU\)",
]


def test_no_page_contradicts_the_status_of_what_ran_where():
    """#54: context-parallel.md said 'Nothing multi-rank ran on a GPU', measuring.md 'Nothing here has been
    measured on a GPU', the README 'Run for real on CPU only', against the H100 rows. One status, in
    docs/compatibility.md; the other pages link it."""
    compatibility = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    assert compatibility.count("\n" + STATUS + "\n") == 1
    found = []
    for path in [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]:
        text = path.read_text(encoding="utf-8")
        if path.name == "compatibility.md":
            start = text.index(STATUS)
            text = text[:start] + text[text.index("\n## ", start + 1):]
        if path.name == "RESULTS.md":
            text = text.split("\n## ", 2)[1]  # its preamble and the ledger (the rows below keep their day's words)
        for pattern in CONTRADICTIONS:
            found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in re.finditer(pattern, text, re.I)]
    assert not found, found
    linked = [page.relative_to(ROOT) for page in PAGES if "what-ran-where" in page.read_text(encoding="utf-8")]
    assert ROOT / "README.md" in [ROOT / p for p in linked], "README links the status"
