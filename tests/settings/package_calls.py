"""The package's calls, read from its source (ast): where each call is (module, enclosing function)
and what it calls, for the source checks that hold the package to an allow-list."""

from __future__ import annotations

import ast
import functools
import pathlib
from dataclasses import dataclass

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "coc_inject"


@dataclass(frozen=True)
class Site:
    module: str  # path under coc_inject/, e.g. "moe/counts.py"
    function: str  # enclosing classes and functions, dotted ("" at module level)
    line: int
    call: ast.Call
    parent: ast.AST  # the node the call sits in

    def where(self) -> str:
        return f"coc_inject/{self.module}:{self.line} in {self.function or '<module>'}"


@functools.lru_cache(maxsize=1)
def calls() -> tuple:
    """Every call in the package's source (read once per test process)."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        _visit(tree, module, [], None, sites)
    return tuple(sites)


def _visit(node, module: str, scope: list, parent, sites: list) -> None:
    if isinstance(node, ast.Call):
        sites.append(Site(module, ".".join(scope), node.lineno, node, parent))
    inner = scope + [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
    for child in ast.iter_child_nodes(node):
        _visit(child, module, inner, node, sites)


def method_name(call: ast.Call) -> str | None:
    """``x.name(...)`` -> name; anything else None."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def torch_function(call: ast.Call) -> str | None:
    """``torch.name(...)`` -> name; anything else None."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch":
        return func.attr
    return None


def matches(site: Site, entry: tuple) -> bool:
    """An allow-list entry (module, function or "*" for the whole module, what) names ``site``."""
    module, function, _ = entry
    return site.module == module and function in ("*", site.function)
