"""Cross-rank agreement: every rank of a group must run the same CoC configuration.

Ranks that chunk differently issue different collectives, which hangs or, worse, silently
mixes rows. So the first CoC call on each process group compares one integer (the config
fingerprint) from every rank: a mismatch raises the same error on every rank, and a rank that
never joins (CoC off there) ends in a timeout error, not a hang.

The fingerprints travel through the job's rendezvous store (torch.distributed's default store),
never the group's communicator: a peer without coc-inject issues Megatron's own collectives on
that communicator, and an all-gather of ours there would pair with one of them (on NCCL / HCCL a
hang or rows mixed silently; issue #41). The store is keyed by the group's name and ranks, and by
how many times this process agreed over that group before (a group destroyed and made again).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

AGREEMENT_TIMEOUT = datetime.timedelta(seconds=60)
KEY_PREFIX = "coc-inject/agreement"

# id -> the group itself: holding it keeps its id from being reused by a later group (a test
# or a job that destroys and re-creates its groups), which would skip that group's check.
_agreed_groups: dict = {}
_rounds: dict = {}  # (prefix, group name, ranks) -> agreements this process made over it (the store keys' suffix)


class ConfigMismatchError(RuntimeError):
    pass


def ensure_same_config(group, config, what: str = "") -> None:
    """Raise :class:`ConfigMismatchError` unless every rank of ``group`` has ``config``'s fingerprint.

    After a group's first check this is one dict lookup: the fingerprint (a hash of the settings)
    and the description are made only when the group is checked; nothing of it runs on a device."""
    if _agreed_groups.get(id(group)) is group:
        return
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    values = _exchange(group, ranks, config.fingerprint())
    if len(set(values)) != 1:
        table = ", ".join(f"rank {rank}: {value:#x}" for rank, value in zip(ranks, values))
        raise ConfigMismatchError(
            "CoC configuration differs across the ranks of one process group "
            f"({table}). Every rank must see the same COC_* environment / COC_CONFIG file. "
            f"This rank: {what}{config.describe()}"
        )
    _agreed_groups[id(group)] = group


def _exchange(group, ranks: list, fingerprint: int) -> list:
    """Every rank's fingerprint, in group rank order, through the store (module docstring)."""
    store = _store()
    name = getattr(group, "group_name", "") or ""
    round_key = (KEY_PREFIX, name, tuple(ranks))
    round_ = _rounds.get(round_key, 0)
    _rounds[round_key] = round_ + 1
    prefix = f"{KEY_PREFIX}/{name}/{'-'.join(map(str, ranks))}/{round_}"
    store.set(f"{prefix}/{dist.get_rank()}", str(fingerprint))
    keys = [f"{prefix}/{rank}" for rank in ranks]
    try:
        store.wait(keys, AGREEMENT_TIMEOUT)
    except Exception as error:  # torch raises DistStoreError (a RuntimeError) or RuntimeError by release
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        raise ConfigMismatchError(
            f"CoC configuration check timed out after {AGREEMENT_TIMEOUT.total_seconds():g}s on a "
            f"process group of {len(ranks)} ranks ({ranks}); ranks {missing} never joined: is coc-inject "
            f"enabled on every rank (same COC_* environment on every node)? ({error})"
        ) from error
    return [int(store.get(key).decode()) for key in keys]


def _store():
    """The job's rendezvous store (every process group's ranks reach it)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def forget() -> None:
    _agreed_groups.clear()
