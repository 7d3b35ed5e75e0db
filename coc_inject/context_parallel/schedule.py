"""Which schedule one rank runs for an algorithm: the groups, ring positions and chunk ids.

Pure glue between the process groups (made once, where every rank passes: see groups.py) and
the schedules; built once per attention layer and kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from coc_inject.context_parallel import layout
from coc_inject.context_parallel.ring import Ring

RING, ULYSSES, HYBRID, ALLGATHER = "ring", "ulysses", "hybrid", "allgather"
ALGORITHMS = (RING, ULYSSES, HYBRID, ALLGATHER)
# COC_FLASH_ATTN at CP = 1: the whole sequence as one chunk, a ring of one (no transfer).
LOCAL = "local"


@dataclass(frozen=True)
class Schedule:
    """How one rank runs one attention layer's context-parallel calls."""

    algorithm: str
    cp_group: object
    cp_size: int
    q_ids: tuple  # chunk ids of the queries attention sees (after the all-to-all, if any)
    causal: bool
    scale: float
    ring: Ring | None = None
    heads_group: object = None  # Ulysses' all-to-all group (None: no all-to-all)
    heads_size: int = 1

    @property
    def window(self) -> int:
        return self.ring.window if self.ring is not None else 1


def make_schedule(algorithm: str, cp_group, *, causal: bool, scale: float, window: int = 1,
                  ulysses_group=None, ulysses_size: int = 1) -> Schedule:
    """``algorithm`` over ``cp_group``; hybrid takes this rank's Ulysses group of ``ulysses_size``
    consecutive CP ranks, and ``window`` applies to the ring part (ring, hybrid)."""
    if algorithm == LOCAL:
        return Schedule(algorithm, None, 1, (0,), causal, scale, ring=Ring(None, (0,), 0, 1, ((0,),)))
    size, rank = cp_group.size(), cp_group.rank()
    global_ranks = [dist.get_global_rank(cp_group, r) for r in range(size)]
    common = dict(algorithm=algorithm, cp_group=cp_group, cp_size=size, causal=causal, scale=scale)
    if algorithm == ALLGATHER:
        return Schedule(q_ids=layout.rank_chunks(rank, size), **common)
    if algorithm == RING:
        ring = Ring(cp_group, tuple(global_ranks), rank, window,
                    tuple(layout.rank_chunks(p, size) for p in range(size)))
        return Schedule(q_ids=layout.rank_chunks(rank, size), ring=ring, **common)
    if algorithm == ULYSSES:
        ulysses_group, ulysses_size, window = cp_group, size, 1
    elif algorithm != HYBRID:
        raise ValueError(f"unknown context-parallel algorithm {algorithm!r}: expected one of {ALGORITHMS}")
    u = ulysses_size
    mine, offset = divmod(rank, u)
    members = [range(g * u, (g + 1) * u) for g in range(size // u)]
    ring = Ring(cp_group, tuple(global_ranks[g * u + offset] for g in range(size // u)), mine, window,
                tuple(layout.gathered_chunks(m, size) for m in members))
    return Schedule(q_ids=layout.gathered_chunks(members[mine], size), ring=ring, heads_group=ulysses_group,
                    heads_size=u, **common)
