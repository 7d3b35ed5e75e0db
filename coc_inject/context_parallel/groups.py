"""Hybrid's Ulysses groups: made where every rank passes, never inside a forward.

``new_group`` is collective over the whole world, so a group made lazily in a forward that
pipeline stages reach at different times would hang. When Megatron's
``hierarchical_context_parallel_sizes`` gives them, its own level-1 groups are used; otherwise
they are made right after ``initialize_model_parallel`` (:func:`making_configured` wraps it), for every
context-parallel group of the job, in the same order on every rank: consecutive CP ranks, as
Megatron's hierarchical groups are.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

_made: dict = {}  # Ulysses degree -> this rank's group


def make_ulysses_groups(degree: int, cp_global_ranks) -> None:
    """Collective over the world: every rank passes its CP group's global ranks."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(cp_global_ranks))
    me = dist.get_rank()
    for ranks in sorted({tuple(r) for r in everyone}):
        for start in range(0, len(ranks), degree):
            members = list(ranks[start:start + degree])
            group = dist.new_group(members)
            if me in members:
                _made[degree] = group


def make_configured(degree: int | None, parallel_state) -> None:
    """Hybrid's Ulysses groups for COC_CP_ULYSSES_DEGREE where it splits Megatron's CP size (collective)."""
    cp_size = parallel_state.get_context_parallel_world_size()
    if degree is not None and 1 < degree < cp_size and cp_size % degree == 0:
        make_ulysses_groups(degree, parallel_state.get_context_parallel_global_ranks())


def ulysses_group(degree: int, megatron_config, parallel_state):
    """This rank's Ulysses group of ``degree`` consecutive CP ranks, or None where none was made."""
    if list(getattr(megatron_config, "hierarchical_context_parallel_sizes", None) or [])[:1] == [degree]:
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        if groups:
            return groups[0]
    return _made.get(degree)


def release() -> None:
    """Destroy the groups made here (as Megatron's destroy_model_parallel destroys its gloo groups: a
    live group keeps its communicator and threads) and forget them."""
    for group in _made.values():
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError, AssertionError):
            pass  # the default group, and with it every group, is already gone
    _made.clear()


def making_configured(original_init, degree: int | None, parallel_state):
    """Megatron's ``initialize_model_parallel``, then :func:`make_configured` (every rank passes)."""

    @functools.wraps(original_init)
    def initialize_model_parallel(*args, **kwargs):
        result = original_init(*args, **kwargs)
        make_configured(degree, parallel_state)
        return result

    return initialize_model_parallel


def releasing(original_destroy):
    """Megatron's ``destroy_model_parallel``, after :func:`release`."""

    @functools.wraps(original_destroy)
    def destroy_model_parallel(*args, **kwargs):
        release()
        return original_destroy(*args, **kwargs)

    return destroy_model_parallel
