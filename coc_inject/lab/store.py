"""The lab's rendezvous store: one rank is here, so a key another rank would write is answered
from this rank's. The settings agreement (coc_inject.pipeline.agreement) writes
``<prefix>/<rank>`` and waits for every rank's key; here a missing ``<prefix>/<r>`` reads
``<prefix>/<this rank>``: every rank agrees with this one, and a real job's agreement is unchanged."""

from __future__ import annotations

import datetime
import re

import torch.distributed as dist

_RANKED = re.compile(r"^(.*)/(\d+)$")


class MirrorStore(dist.Store):
    def __init__(self, rank: int):
        super().__init__()
        self._rank, self._store = rank, dist.HashStore()

    def _resolve(self, key: str) -> str:
        if self._store.check([key]):
            return key
        match = _RANKED.match(key)
        if match:
            mine = f"{match.group(1)}/{self._rank}"
            if self._store.check([mine]):
                return mine
        return key

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key):
        return self._store.get(self._resolve(key))

    def check(self, keys):
        return self._store.check([self._resolve(key) for key in keys])

    def wait(self, keys, timeout=None):
        resolved = [self._resolve(key) for key in keys]
        if timeout is None:
            return self._store.wait(resolved)
        return self._store.wait(resolved, timeout if isinstance(timeout, datetime.timedelta)
                                else datetime.timedelta(seconds=timeout))

    def add(self, key, amount):
        return self._store.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._store.delete_key(key)

    def num_keys(self):
        return self._store.num_keys()

    def set_timeout(self, timeout):
        return self._store.set_timeout(timeout)
