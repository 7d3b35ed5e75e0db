"""Cross-rank agreement: every rank of a group must run the same CoC configuration.

Ranks that chunk differently issue different collectives, which hangs or, worse, silently
mixes rows. So the first CoC call on each process group gathers one integer (the config
fingerprint) from every rank and compares them: a mismatch raises the same error on every
rank, and a rank that never joins (CoC off there) ends in a timeout error, not a hang.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

AGREEMENT_TIMEOUT = datetime.timedelta(seconds=60)

# id -> the group itself: holding it keeps its id from being reused by a later group (a test
# or a job that destroys and re-creates its groups), which would skip that group's check.
_agreed_groups: dict = {}


class ConfigMismatchError(RuntimeError):
    pass


def ensure_same_config(group, config, device: torch.device, what: str = "") -> None:
    """Raise :class:`ConfigMismatchError` unless every rank of ``group`` has ``config``'s fingerprint.

    After a group's first check this is one dict lookup: the fingerprint (a hash of the settings)
    and the description are made only when the group is checked."""
    if _agreed_groups.get(id(group)) is group:
        return
    fingerprint = config.fingerprint()
    size = group.size()
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    everyone = torch.empty(size, dtype=torch.int64, device=device)
    handle = dist.all_gather(list(everyone.chunk(size)), mine, group=group, async_op=True)
    try:
        handle.wait(timeout=AGREEMENT_TIMEOUT)
    except RuntimeError as error:
        raise ConfigMismatchError(
            f"CoC configuration check timed out after {AGREEMENT_TIMEOUT.seconds}s on a "
            f"process group of {size} ranks: is coc-inject enabled on every rank "
            f"(same COC_* environment on every node)? ({error})"
        ) from error
    values = everyone.tolist()
    if len(set(values)) != 1:
        ranks = [dist.get_global_rank(group, r) for r in range(size)]
        table = ", ".join(f"rank {rank}: {value:#x}" for rank, value in zip(ranks, values))
        raise ConfigMismatchError(
            "CoC configuration differs across the ranks of one process group "
            f"({table}). Every rank must see the same COC_* environment / COC_CONFIG file. "
            f"This rank: {what}{config.describe()}"
        )
    _agreed_groups[id(group)] = group


def forget() -> None:
    _agreed_groups.clear()
