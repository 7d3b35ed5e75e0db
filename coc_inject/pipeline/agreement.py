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
Each rank sets its settings there (the fingerprint, the agreed settings' values to name a difference,
and what the calling wing knows of this process that changes what it sends: its ``facts``), so a
mismatch names the setting, its values and the ranks holding each. Every wing that changes what a
rank sends checks at its first call (:class:`FirstCall`): the linears and the attention per group,
the copies over their block's groups, the MoE pieces over the expert groups. A check over a group
already agreed is one dict lookup; the exchanges of every wing on one group share its keys, so a rank
whose copies check and a rank whose linears check over the same group meet there.
"""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist

AGREEMENT_TIMEOUT = datetime.timedelta(seconds=60)
KEY_PREFIX = "coc-inject/agreement"

# id -> the group itself: holding it keeps its id from being reused by a later group (a test
# or a job that destroys and re-creates its groups), which would skip that group's check.
_agreed_groups: dict = {}
_rounds: dict = {}  # (prefix, group name, ranks) -> agreements this process made over it (the store keys' suffix)


class ConfigMismatchError(RuntimeError):
    pass


def ensure_same_config(group, config, what: str = "", facts: dict | None = None) -> None:
    """Raise :class:`ConfigMismatchError` unless every rank of ``group`` has ``config``'s fingerprint
    (and, where the ranks give the same one, ``facts``: what the calling wing knows of this process
    that changes what it sends, e.g. whether its copies can run here).

    After a group's first check this is one dict lookup: the fingerprint (a hash of the settings)
    and the description are made only when the group is checked; nothing of it runs on a device."""
    if _agreed_groups.get(id(group)) is group:
        return
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    mine = {"fingerprint": config.fingerprint(), "settings": config.agreed_values(), "facts": facts or {}}
    payloads = _exchange(group, ranks, mine, what)
    differences = _differences(ranks, payloads)
    if differences:
        raise ConfigMismatchError(
            f"CoC configuration differs across the ranks of one process group (ranks {ranks}): "
            f"{'; '.join(differences)}. Every rank must see the same COC_* environment / COC_CONFIG file. "
            f"This rank ({dist.get_rank()}) checked for {what or 'a CoC call'}: {config.describe()}"
        )
    _agreed_groups[id(group)] = group


class FirstCall:
    """A wing's check at its first call: ``if check.pending: check(groups)``; afterwards ``pending`` is
    False, one attribute read per call. One per wing and installation (``job.uninstall()`` makes the
    next installation's wings check again)."""

    def __init__(self, config, what: str):
        self.config, self.what, self.pending = config, what, True

    def __call__(self, groups, facts: dict | None = None) -> None:
        """:func:`ensure_same_config` over each of ``groups`` in order (None and one-rank groups
        skipped; nothing without torch.distributed)."""
        if dist.is_available() and dist.is_initialized():
            for group in groups:
                if group is not None and group.size() > 1:
                    ensure_same_config(group, self.config, self.what, facts)
        self.pending = False


def _differences(ranks: list, payloads: list) -> list:
    """What differs across ``payloads`` (in rank order), each as "NAME is V on ranks [0, 1] and W on rank 2":
    the settings where the fingerprints differ (the fingerprints themselves where no value
    shows why: another coc-inject release), else the facts every rank gave; empty: they agree."""
    if len({payload["fingerprint"] for payload in payloads}) > 1:
        found = _differing(ranks, [payload.get("settings", {}) for payload in payloads], every=False)
        return found or ["fingerprints " + ", ".join(f"rank {rank}: {payload['fingerprint']:#x}"
                                                     for rank, payload in zip(ranks, payloads))]
    # facts one wing gives and another's check on the same group does not: nothing to compare
    return _differing(ranks, [payload.get("facts", {}) for payload in payloads], every=True)


def _differing(ranks: list, tables: list, every: bool) -> list:
    differences = []
    for name in dict.fromkeys(name for table in tables for name in table):
        if every and not all(name in table for table in tables):
            continue
        by_value: dict = {}
        for rank, table in zip(ranks, tables):
            by_value.setdefault(json.dumps(table.get(name, "(not known there)")), []).append(rank)
        if len(by_value) > 1:
            differences.append(f"{name} is " + " and ".join(
                f"{json.loads(value)} on " + (f"rank {on[0]}" if len(on) == 1 else f"ranks {on}")
                for value, on in by_value.items()))
    return differences


def _exchange(group, ranks: list, mine: dict, what: str = "") -> list:
    """Every rank's payload, in group rank order, through the store (module docstring)."""
    store = _store()
    name = getattr(group, "group_name", "") or ""
    round_key = (KEY_PREFIX, name, tuple(ranks))
    round_ = _rounds.get(round_key, 0)
    _rounds[round_key] = round_ + 1
    prefix = f"{KEY_PREFIX}/{name}/{'-'.join(map(str, ranks))}/{round_}"
    store.set(f"{prefix}/{dist.get_rank()}", json.dumps(mine))
    keys = [f"{prefix}/{rank}" for rank in ranks]
    try:
        store.wait(keys, AGREEMENT_TIMEOUT)
    except Exception as error:  # torch raises DistStoreError (a RuntimeError) or RuntimeError by release
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        raise ConfigMismatchError(
            f"CoC configuration check timed out after {AGREEMENT_TIMEOUT.total_seconds():g}s on a "
            f"process group of {len(ranks)} ranks ({ranks}); ranks {missing} never joined: is coc-inject "
            f"enabled on every rank (same COC_* environment on every node)? A rank without coc-inject (no "
            f"bootstrap) or with this wing off never checks. This rank ({dist.get_rank()}) checked for "
            f"{what or 'a CoC call'}. ({error})"
        ) from error
    return [_payload(store.get(key).decode()) for key in keys]


def _payload(text: str) -> dict:
    """A rank's payload; a bare fingerprint (an older coc-inject on that rank) as one without settings."""
    value = json.loads(text)
    return value if isinstance(value, dict) else {"fingerprint": int(value), "settings": {}, "facts": {}}


def _store():
    """The job's rendezvous store (every process group's ranks reach it)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def forget() -> None:
    _agreed_groups.clear()
