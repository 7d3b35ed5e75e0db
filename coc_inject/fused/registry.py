"""Which fused backend runs a call: the first usable one, or the pinned one, or none."""

from __future__ import annotations

from coc_inject.fused.atb import AtbBackend
from coc_inject.fused.mc2 import Mc2Backend
from coc_inject.fused.symm_mem import SymmMemBackend

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


def status() -> dict:
    """Backend name -> None if it can run in this process, else why not."""
    return {name: backend.unavailable() for name, backend in BACKENDS.items()}
