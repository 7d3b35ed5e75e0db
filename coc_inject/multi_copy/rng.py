"""The random-number state a copy owns between its turns.

Megatron's RNG tracker forks around a whole TransformerBlock under sequence parallelism (and
around dropout): a fork saves the current state, sets the tracker's, and restores on exit. Two
copies forking in turns would restore each other's states, so each copy keeps its own: the
torch generators and the tracker's states, saved at a hand-over and restored at the next turn.
"""

from __future__ import annotations

import torch

from coc_inject.multi_copy.scheduler import accelerators


def _tracker():
    try:
        from megatron.core.tensor_parallel import random as megatron_random
    except ImportError:
        return None
    tracker = getattr(megatron_random, "_CUDA_RNG_STATE_TRACKER", None)
    return tracker if getattr(tracker, "states_", None) is not None else None


def save() -> tuple:
    tracker = _tracker()
    devices = [(module, module.get_rng_state()) for _, module in accelerators()]  # CUDA's, NPU's
    tracked = None
    if tracker is not None:
        tracked = (dict(tracker.states_), getattr(tracker, "_current_state_name", None))
    return torch.get_rng_state(), devices, tracker, tracked


def restore(state: tuple) -> None:
    cpu, devices, tracker, tracked = state
    torch.set_rng_state(cpu)
    for module, device_state in devices:
        module.set_rng_state(device_state)
    if tracker is not None and tracked is not None:
        tracker.states_ = dict(tracked[0])
        if tracked[1] is not None:
            tracker._current_state_name = tracked[1]
