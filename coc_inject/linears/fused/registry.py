"""Which fused backend runs a call: the first usable one, or the pinned one, or none."""

from __future__ import annotations

import logging

from coc_inject import log
from coc_inject.linears.fused.atb import AtbBackend
from coc_inject.linears.fused.mc2 import Mc2Backend
from coc_inject.linears.fused.symm_mem import SymmMemBackend

BACKENDS = {backend.name: backend for backend in (AtbBackend(), Mc2Backend(), SymmMemBackend())}
CHOICES = ("auto", "chunked", *BACKENDS)


def choose(op: str, x, weight, group, pinned: str = "auto"):
    """``(backend, None)`` for the backend that runs this call, or ``(None, why not)``."""
    if pinned == "chunked":
        return None, "COC_FUSED_BACKEND=chunked"
    candidates = list(BACKENDS.values()) if pinned == "auto" else [BACKENDS[pinned]]
    reasons = []
    for backend in candidates:
        reason = backend.unsupported(op, x, weight, group)
        if reason is None:
            return backend, None
        reasons.append(f"{backend.name}: {reason}")
    return None, "; ".join(reasons)


def select(op: str, x, weight, group, pinned: str, who: str, instead: str):
    """:func:`choose`, saying once (per caller, op and reason) why no fused backend runs the call."""
    backend, why = choose(op, x, weight, group, pinned)
    if backend is None:
        log.once(("fused-unavailable", who, op, why), logging.WARNING,
                 f"{who}: fused kernel requested for {op}, but no fused backend can run it ({why}); {instead}")
    return backend


def status() -> dict:
    """Backend name -> None if it can run in this process, else why not."""
    return {name: backend.unavailable() for name, backend in BACKENDS.items()}
