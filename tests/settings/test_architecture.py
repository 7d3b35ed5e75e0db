"""docs/architecture.md is true: its floors are the imports' floors, its layout names what exists.

The floors block lists every module of the package on one floor; an import (lazy ones too) may
only reach its own floor or one below, and no modules or floor entries import each other round a
loop. The layout block names every package, and every file or folder the page names exists.
"""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "coc_inject"
DOC = (REPO / "docs" / "architecture.md").read_text()


def _block(heading: str) -> list[str]:
    section = DOC.split(f"## {heading}\n", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def floors() -> dict[str, int]:
    """Entry ('linears/', 'job.py', ...) -> its floor number, from the page's floors block."""
    entries, floor = {}, None
    for line in _block("Floors"):
        match = re.match(r"floor (\d+) \([^)]*\)\s*(.*)$", line)
        if match:
            floor, line = int(match.group(1)), match.group(2)
        for entry in line.split():
            assert floor is not None, line
            assert entry not in entries, f"{entry} is on two floors"
            entries[entry] = floor
    return entries


def modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def entry_of(name: str, entries) -> str:
    relative = name.split(".")[1:]
    candidates = [e for e in entries
                  if (e.endswith("/") and relative[:len(e.rstrip("/").split("/"))] == e.rstrip("/").split("/"))
                  or e == "/".join(relative) + ".py" or (e == "__init__.py" and not relative)]
    assert len(candidates) == 1, f"{name}: on {candidates or 'no'} floor entry of docs/architecture.md"
    return candidates[0]


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The package's modules that ``name`` imports, lazily or not (import_module of a constant too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            targets.add(node.args[0].value)
    return {t for t in targets if t in known and t != name and t.startswith("coc_inject")}


def _cycle(graph: dict) -> list | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_floor_entry_exists():
    for entry in floors():
        path = PACKAGE / entry
        assert (path / "__init__.py").exists() if entry.endswith("/") else path.exists(), entry


def test_imports_go_down_the_floors_only():
    entries, known = floors(), modules()
    upward = []
    for name, path in known.items():
        here = entry_of(name, entries)
        for target in imports(name, path, known):
            there = entry_of(target, entries)
            if entries[there] > entries[here]:
                upward.append(f"{name} (floor {entries[here]}) imports {target} (floor {entries[there]})")
    assert upward == [], "\n".join(upward)


def test_no_circles_of_modules_or_of_floor_entries():
    entries, known = floors(), modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # A package's __init__ importing its own modules is how a package reads, not a circle.
    files = {name: {t for t in targets if not name.startswith(t + ".") and not t.startswith(name + ".")}
             for name, targets in graph.items()}
    assert _cycle(files) is None
    rooms = {}
    for name, targets in graph.items():
        here = entry_of(name, entries)
        rooms.setdefault(here, set()).update(entry_of(t, entries) for t in targets if entry_of(t, entries) != here)
    assert _cycle(rooms) is None


def test_layout_names_every_package_and_only_what_exists():
    listed = set()
    for line in _block("Layout"):
        if line and not line[0].isspace():
            path = line.split()[0]
            listed.add(path)
            assert (REPO / path).exists(), f"docs/architecture.md's layout names {path}, which does not exist"
    packages = {str(p.parent.relative_to(REPO)) + "/" for p in PACKAGE.rglob("__init__.py")
                if p.parent != PACKAGE and "cases" not in p.parent.parts}
    assert packages - listed == set(), "packages missing from docs/architecture.md's layout"


def test_every_file_the_page_names_exists():
    files = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    missing = []
    for name in set(re.findall(r"`([\w./-]+(?:\.py|/))`", DOC)):
        bare = name.rstrip("/")
        if not any(f == bare or f.endswith("/" + bare) for f in files):
            missing.append(name)
    assert missing == []
