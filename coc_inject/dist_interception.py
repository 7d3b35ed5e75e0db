"""Every replacement of ``torch.distributed``'s collectives, and of Megatron's module-level aliases of
them, goes through here: multi-copy's (only while copies run), the bench's compute-only twin and the
tests' recorders. One place knows which functions there are and where Megatron bound copies of them
at its import; each user says only what to put in their place.

Replacements nest: a later one wraps whatever is in place when it is entered (a recorder beneath
multi-copy's wrappers sees the order collectives reach the network), and leaving puts back what was
there. Multi-copy's is shared by the threads running copies: the first to enter puts the wrappers in,
the last to leave takes them out.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading

import torch.distributed as dist

# torch.distributed's collectives that Megatron's layers and coc-inject's engines call (all with an
# ``async_op`` parameter but batch_isend_irecv, whose point-to-point works are always asynchronous).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all", "broadcast",
               "batch_isend_irecv")
# torch 2.13's single-tensor forms, which coc-inject's chunked pipeline prefers where they exist
# (pipeline/collectives.py).
SINGLE_TENSOR = ("all_gather_single", "reduce_scatter_single")
# The one list every replacement takes: multi-copy's interception, the meter, the compute-only twin (which
# leaves some running: testbed/link.py) and the tests' recorders. A name this torch lacks is skipped.
EVERY_COLLECTIVE = COLLECTIVES + SINGLE_TENSOR
# torch.distributed's other collective functions, and why no replacement takes them (a test holds every
# collective function of torch.distributed to one of the two lists).
NOT_REPLACED = {
    "all_reduce_coalesced": "deprecated; neither Megatron's layers nor coc-inject call it",
    "all_gather_coalesced": "deprecated; neither Megatron's layers nor coc-inject call it",
    "_broadcast_coalesced": "DDP's parameter broadcast at construction, before any step",
    "all_gather_object": "pickled control data (configs, counts), not a layer's tensors",
    "broadcast_object_list": "pickled control data; auto's cached-decision broadcast is one",
    "gather_object": "pickled control data", "scatter_object_list": "pickled control data",
    "send_object_list": "pickled control data", "recv_object_list": "pickled control data",
    "reduce": "to one rank: neither Megatron's layers nor coc-inject call it",
    "gather": "to one rank: neither Megatron's layers nor coc-inject call it",
    "scatter": "from one rank: neither Megatron's layers nor coc-inject call it",
    "send": "point to point between pipeline stages, outside every wing's layers (Megatron batches them: "
            "batch_isend_irecv)",
    "recv": "point to point between pipeline stages, outside every wing's layers",
    "isend": "point to point between pipeline stages, outside every wing's layers",
    "irecv": "point to point between pipeline stages, outside every wing's layers",
    "barrier": "a synchronisation, no data: the meter would charge its skew to no one",
    "monitored_barrier": "a synchronisation, no data",
}
# Megatron binds these at import: module -> names holding a torch.distributed collective.
MEGATRON_ALIASES = {
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.utils": ("dist_all_gather_func",),  # the embedding's deferred weight gradient
}


def async_op_index(function) -> int | None:
    """Where ``function`` (a collective, or whatever wraps one in place) takes ``async_op`` positionally;
    None where only by keyword (``def call(*args, async_op=False, **kwargs)``, another tool's wrapper) or
    not at all. Read through ``__wrapped__``; made once per function by the callers (signatures are slow)."""
    return parameter_index(function, "async_op")


def parameter_index(function, name: str) -> int | None:
    """Where ``function`` takes its parameter ``name`` positionally (``group``: Megatron's distributed
    optimizer passes it third to ``all_gather``); None where only by keyword or not at all. Read through
    ``__wrapped__``; made once per function by the callers."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return None  # *args or keyword-only from here on
        if parameter.name == name:
            return index
    return None


def _positional(async_index: int | None, args) -> bool:
    """Was ``async_op`` given positionally (at ``async_index``) in this call?"""
    return async_index is not None and len(args) > async_index


def is_async(async_index: int | None, args, kwargs) -> bool:
    """Did this call ask for a handle (``async_op``, by keyword or at ``async_index``)?"""
    return bool(args[async_index] if _positional(async_index, args) else kwargs.get("async_op", False))


def made_async(async_index: int | None, args, kwargs) -> tuple:
    """``(asked, args, kwargs)``: whether the call asked for a handle, and its arguments with
    ``async_op=True`` where it was given (positionally at ``async_index``, else by keyword)."""
    asked = is_async(async_index, args, kwargs)
    if _positional(async_index, args):
        return asked, args[:async_index] + (True,) + args[async_index + 1:], kwargs
    return asked, args, {**kwargs, "async_op": True}


def _sites(make, names, import_aliases: bool) -> list:
    """``(owner, attribute, replacement)`` for each collective in ``names`` that ``make(name, what_was_there)``
    replaces (None: left as it is), in torch.distributed and in every Megatron alias holding it: in the
    alias modules imported now, or (``import_aliases``) imported here, so that none binds a replacement at
    its import and keeps it after."""
    sites, replacements = [], {}
    for name in names:
        current = getattr(dist, name, None)
        replacement = None if current is None else make(name, current)
        if replacement is not None:
            replacements[current] = replacements[inspect.unwrap(current)] = replacement
            sites.append((dist, name, replacement))
    for module_name, aliases in MEGATRON_ALIASES.items():
        try:
            module = importlib.import_module(module_name) if import_aliases else sys.modules.get(module_name)
        except ImportError:
            continue
        for alias in aliases if module is not None else ():
            current = getattr(module, alias, None)
            replacement = replacements.get(current) or replacements.get(inspect.unwrap(current))
            if replacement is not None:
                sites.append((module, alias, replacement))
    return sites


@contextlib.contextmanager
def replaced(make, names=EVERY_COLLECTIVE):
    """Inside, each collective in ``names`` is ``make(name, what_was_there)`` (None: left as it is),
    in torch.distributed and in every Megatron alias holding it."""
    saved = []
    for owner, name, replacement in _sites(make, names, import_aliases=True):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def patch_all(make, patches, names=EVERY_COLLECTIVE) -> None:
    """For a whole job: each collective in ``names`` replaced by ``make(name, what_was_there)`` (None:
    left as it is), in torch.distributed and in the Megatron aliases already imported, through
    ``patches`` (coc_inject.patches.Patches: undone by its restore). COC_MEASURE's meter."""
    for owner, name, replacement in _sites(make, names, import_aliases=False):
        patches.patch(owner, name, replacement)


class Shared:
    """One replacement entered by several threads at once (multi-copy's copies, a run inside a copy):
    in from the first :meth:`entered` to the last one's end."""

    def __init__(self, make):
        self._make = make
        self._lock = threading.Lock()
        self._depth = 0
        self._context = None

    @contextlib.contextmanager
    def entered(self):
        with self._lock:
            if self._depth == 0:
                self._context = replaced(self._make)
                self._context.__enter__()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    context, self._context = self._context, None
                    context.__exit__(None, None, None)
