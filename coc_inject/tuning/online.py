"""``COC_PARALLEL_NUM=auto``: each shape's chunk count, chosen at run time, the same on every rank.
(``COC_CP_ALGO=auto`` uses the same tuner for the context-parallel algorithm: :meth:`Tuner.decide`
among named candidates, with a baseline in place of N=1.)

A decision is made once per :class:`DecisionKey` (layer case, m, k, n, dtype, TP size, device
type, with or without backward), at the first call of that key; the cache keys it further by the
hardware identity (device or host name, world and TP size, communication backend):

1. **Cache, agreed.** Group rank 0 looks the key up in the tune cache and broadcasts what it
   found; every rank of the group uses that, whatever its own cache file says.
2. **Trials** when nothing is cached: every candidate -- Megatron's own path (N=1) and each CoC
   chunk count the rows allow -- runs forward and backward on this call's real input (one
   warm-up round, then ``TIMED_ROUNDS`` timed rounds in rotating order; a barrier before each
   run, device synchronisation around it on CUDA/NPU, wall clock on CPU: coc_inject.timer). The trials run on
   detached inputs and return nothing to autograd, inside ``coc_inject.trial.isolated``: parameters'
   gradients (``main_grad`` with fused accumulation included) and the RNG are left as found; the
   job's own call runs afterwards with the decision. Each run's time is all-reduced with MAX over the
   group, so every rank sees the same numbers and decides the same N. A CoC count wins only if
   its median beats N=1's by more than the noise (the larger of ``NOISE_FLOOR`` of N=1's median
   and the half-ranges of both candidates' timings); otherwise N=1: Megatron's own forward.
3. The decision is logged once and written to the cache by group rank 0.

With ``COC_DETERMINISTIC=1`` no trials run (timings differ from run to run, and so would the
chunking): a cached decision is used, else N=1.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch
import torch.distributed as dist

from coc_inject import copy_context, log, timer, trial
from coc_inject.routes import LayerCase

TIMED_ROUNDS = 3
NOISE_FLOOR = 0.03  # a CoC count must be at least 3% faster than Megatron's path


class Key(Protocol):
    """What the tuner decides once for: a hashable key that names itself and its choices. Each wing
    has one (DecisionKey for the linears, context_parallel.auto.AttentionKey, multi_copy.auto.CopiesKey,
    moe.auto.MoEKey)."""

    WARM_UPS: ClassVar[int]  # untimed rounds of every candidate before the timed ones

    def text(self) -> str: ...  # the shape, for the decision's log line

    def cache_fields(self) -> list: ...  # what the cache keys the decision by (with the hardware identity)

    def name(self, choice) -> str: ...  # a choice as the log line names it

    def candidate(self, choice) -> str: ...  # a choice in the log line's list of timings


@dataclass(frozen=True)
class DecisionKey:
    WARM_UPS: ClassVar[int] = 1

    case: LayerCase  # or its value
    m: int
    k: int
    n: int
    dtype: str
    tp: int
    device: str  # device type
    backward: bool

    def text(self) -> str:
        return (f"{self.case} [{self.m}, {self.k}, {self.n}] {self.dtype} TP{self.tp} {self.device}"
                + ("" if self.backward else " forward-only"))

    def cache_fields(self) -> list:
        return [self.case, self.m, self.k, self.n, self.dtype, self.tp, self.device, self.backward]

    def name(self, choice) -> str:
        return "Megatron's own path (N=1)" if choice == 1 else f"N={choice}"

    @staticmethod
    def candidate(choice) -> str:
        return f"N={choice}"


@dataclass(frozen=True)
class Decision:
    choice: object  # a chunk count (COC_PARALLEL_NUM=auto) or an algorithm name (COC_CP_ALGO=auto)
    source: str  # "trials" | "cache" | "deterministic default"
    times_ms: dict  # candidate -> median ms (trials only)
    noise_ms: float = 0.0
    confirmation_ms: dict | None = None  # the second round's medians, baseline and first winner (confirm=True)

    @property
    def chunks(self) -> int:
        return self.choice

    def describe(self, key) -> str:
        text = f"auto: {key.text()} -> {key.name(self.choice)} ({self.source}"
        if self.times_ms:
            times = ", ".join(f"{key.candidate(c)} {t:.2f} ms" for c, t in self.times_ms.items())
            text += f": {times}; noise {self.noise_ms:.2f} ms; median of {TIMED_ROUNDS} runs, max over ranks"
            if self.confirmation_ms:
                again = ", ".join(f"{key.candidate(c)} {t:.2f} ms" for c, t in self.confirmation_ms.items())
                confirmed = self.choice == list(self.confirmation_ms)[-1]  # (baseline, first winner)
                text += f"; a second round {again}: {'confirmed' if confirmed else 'not confirmed, the baseline kept'}"
        return text + ")"


def choose(samples: dict, baseline=1) -> tuple:
    """(choice, noise) from per-candidate timed samples (seconds or ms, any unit); pure.

    The fastest other candidate by median wins only if it beats ``baseline`` (Megatron's N=1, or
    the documented fixed algorithm) by more than the noise."""
    medians = {c: statistics.median(v) for c, v in samples.items()}
    reference = medians[baseline]
    best = min((c for c in medians if c != baseline), key=lambda c: (medians[c], str(c)), default=baseline)
    if best == baseline:
        return baseline, 0.0

    def half_range(values):
        return (max(values) - min(values)) / 2

    noise = max(NOISE_FLOOR * reference, half_range(samples[baseline]), half_range(samples[best]))
    return (best if reference - medians[best] > noise else baseline), noise


def hardware_identity(device: torch.device, group, group_name: str = "TP") -> str:
    """What a cached decision is only valid for: device (or host) name, world and group size, backend."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        name = torch.npu.get_device_name()
    else:
        import socket

        name = f"host {socket.gethostname()}"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return f"{name}; world {world}; {group_name} {group.size()}; {dist.get_backend(group)}"


class Tuner:
    """Decisions of one process, per key; see the module docstring."""

    def __init__(self, config, cache=None):
        self.config = config
        self.cache = cache  # tune_cache.TuneCache or None
        self.decisions: dict[DecisionKey, Decision] = {}

    def chunks(self, key: DecisionKey, group, device: torch.device, rows: int, run: Callable[[int], None],
               touches=()) -> int:
        decision = self.decisions.get(key)
        if decision is not None:  # decided: no candidate list per call
            return decision.choice
        candidates = [1] + [c for c in self.config.tune_candidates if c <= rows]
        return self.decide(key, group, device, candidates, 1, run, touches=touches)

    def decide(self, key, group, device: torch.device, candidates: list, baseline, run: Callable,
               group_name: str = "TP", touches=(), confirm: bool = False):
        """The choice for ``key`` among ``candidates`` (``run(candidate)`` runs one trial), made once.
        ``touches``: the modules the trials run (each trial leaves them as found: coc_inject.trial).
        ``confirm``: a winner other than the baseline is timed again against it in a second round of fresh
        runs and kept only if it wins that too (the fastest of many noisy candidates is flattered by its
        draw: the winner's curse)."""
        decision = self.decisions.get(key)
        if decision is None:
            decision = self.decisions[key] = self._decide(key, group, device, candidates, baseline, run, group_name,
                                                          touches, confirm)
        return decision.choice

    def _decide(self, key, group, device, candidates, baseline, run, group_name, touches, confirm=False) -> Decision:
        identity = hardware_identity(device, group, group_name)
        cached = self._agreed_cached(key, identity, group, device, candidates, baseline if confirm else None)
        if cached is not None:
            decision = Decision(cached, "cache", {})
        elif self.config.deterministic:
            decision = Decision(baseline, "deterministic default: COC_DETERMINISTIC=1 runs no trials and "
                                          "nothing is cached for it", {})
        else:
            samples = self._trials(candidates, group, device, run, key.WARM_UPS, touches)
            choice, noise = choose(samples, baseline)
            confirmation = None
            if confirm and choice != baseline:  # every rank has the same choice (max over ranks): the same runs
                again = self._trials([baseline, choice], group, device, run, 0, touches)
                choice, _ = choose(again, baseline)
                confirmation = {c: statistics.median(v) * 1e3 for c, v in again.items()}
            decision = Decision(choice, "trials", {c: statistics.median(v) * 1e3 for c, v in samples.items()},
                                noise * 1e3, confirmation)
            if self.cache is not None and group.rank() == 0:
                self.cache.put(self.cache.key(key, identity), choice, decision.times_ms, confirmation)
        level = logging.INFO if dist.get_rank() == 0 else logging.DEBUG
        log.logger.log(level, decision.describe(key))
        return decision

    def _agreed_cached(self, key, identity, group, device, candidates, confirmed_against=None):
        """Group rank 0's cached choice, the same on every rank (None: nothing usable cached).
        A cached chunk count is used as it is; a cached name only if it is a candidate here.
        ``confirmed_against`` (a confirm decision's baseline): a cached winner other than it counts
        only with its second round's times (an entry from before the confirmation round was a first
        round's winner, which the second round exists to check)."""
        cache_key = self.cache.key(key, identity) if self.cache is not None else None
        mine = self.cache.get(cache_key) if self.cache is not None else None
        if isinstance(mine, str) and mine not in candidates:
            mine = None
        if confirmed_against is not None and mine is not None and mine != confirmed_against \
                and not self.cache.confirmed(cache_key):
            mine = None
        agreed = [mine]
        dist.broadcast_object_list(agreed, src=dist.get_global_rank(group, 0), group=group, device=device)
        return agreed[0]

    def _trials(self, candidates, group, device, run, warm_ups: int, touches) -> dict:
        # Inside multi-copy's copies: no other copy runs between the timings.
        with copy_context.alone(), trial.isolated(touches):
            return self._timed_trials(candidates, group, device, run, warm_ups)

    def _timed_trials(self, candidates, group, device, run, warm_ups: int) -> dict:
        warm_up, timed = timer.schedule(candidates, TIMED_ROUNDS, warm_ups)
        for chunks in warm_up:
            run(chunks)
        seconds = []
        for chunks in timed:
            timer.align(group, device)
            seconds.append(timer.seconds(lambda: run(chunks), device)[1])
        samples: dict = {c: [] for c in candidates}
        for chunks, t in zip(timed, timer.slowest(seconds, device, group)):
            samples[chunks].append(t)
        return samples


def cache_for(config):
    """The TuneCache of this config (None with COC_TUNE_CACHE=off)."""
    if config.tune_cache is None:
        return None
    from coc_inject.tuning.cache import TuneCache

    return TuneCache(os.path.expanduser(config.tune_cache))
