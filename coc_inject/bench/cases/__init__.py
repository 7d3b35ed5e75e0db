"""The cases of ``coc-inject bench``: one module each, data for the one runner (coc_inject.bench.engine)
and the one report (coc_inject.bench.report).

A new wing adds a case, not a runner: a module here with ``bench(args) -> int`` (its ranks through
coc_inject.testbed.ranks, its variants -- Megatron as it is first, then coc-inject's, and the
compute-only twin where exposed communication is asked for -- measured by ``engine.measure``, its
figures by ``report``), optionally ``add_options(parser)`` for its own flags; then its ``--cases``
words below.
"""

import importlib

CASES = {  # --cases word -> the module that measures it
    "row": "linears", "row-sp": "linears", "column-sp": "linears", "column-bwd": "linears",
    "attention": "attention", "layer": "layer", "moe": "moe",
}


def modules(words=tuple(CASES)) -> list:
    """The case modules of ``words`` (default: every case), each once, in the order above."""
    names = dict.fromkeys(CASES[word] for word in CASES if word in words)
    return [importlib.import_module(f"{__name__}.{name}") for name in names]
