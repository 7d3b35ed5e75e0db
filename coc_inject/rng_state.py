"""The random-number state of this process: torch's generators (CPU and every accelerator in use) and
Megatron's RNG tracker's states, saved and put back as they were.

Two users: a trial (trial.py) leaves the RNG as it found it, so the job's own call draws what it
would have drawn without trials; a multi-copy copy keeps its own state between its turns (Megatron's
tracker forks around a block under sequence parallelism and around dropout: two copies forking in
turns would restore each other's states).
"""

from __future__ import annotations

import sys

import torch

ACCELERATORS = ("cuda", "npu")
_MISSING = object()


def accelerators() -> list:
    """The torch device modules (``torch.cuda``, ``torch.npu`` once torch_npu is imported) in use here,
    as (name, module)."""
    found = []
    for name in ACCELERATORS:
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available() and module.is_initialized():
                found.append((name, module))
        except (AttributeError, RuntimeError):  # a half-present backend: not in use
            continue
    return found


def _tracker():
    random = sys.modules.get("megatron.core.tensor_parallel.random")  # not imported: no tracker to keep
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None)
    return tracker if isinstance(getattr(tracker, "states_", None), dict) else None


def save() -> tuple:
    """torch's generators and Megatron's tracker, as they are (:func:`restore`)."""
    tracker = _tracker()
    tracked = None
    if tracker is not None:
        # A CUDA-graph-safe tracker holds generators, which change in place: keep their state too.
        states = {name: (value, value.get_state() if isinstance(value, torch.Generator) else None)
                  for name, value in tracker.states_.items()}
        tracked = (states, getattr(tracker, "_current_state_name", _MISSING))
    devices = [(module, module.get_rng_state()) for _, module in accelerators()]
    return torch.get_rng_state(), devices, tracker, tracked


def restore(saved: tuple) -> None:
    cpu, devices, tracker, tracked = saved
    torch.set_rng_state(cpu)
    for module, state in devices:
        module.set_rng_state(state)
    if tracker is not None and tracked is not None:
        states, current = tracked
        for value, generator_state in states.values():
            if generator_state is not None:
                value.set_state(generator_state)
        tracker.states_ = {name: value for name, (value, _) in states.items()}
        if current is not _MISSING:
            tracker._current_state_name = current
