"""The persistent store of ``auto`` decisions (``COC_TUNE_CACHE``): one JSON file.

``{"version": 1, "entries": {key: {"chunks": N, "times_ms": {...}, "written": unix time}}}``
(``"choice": name`` in place of ``"chunks"`` for a named choice, e.g. a context-parallel
algorithm; ``"confirmation_ms"``: the second round's times, for a decision that has one); a key is
the decision key's fields plus the hardware identity, as text. Reads happen once per process.
Writes (by one rank per group) take an exclusive ``flock`` on ``PATH.lock``, re-read the file,
merge the entry and replace the file atomically (write to a temporary file, ``os.replace``),
so concurrent jobs never lose each other's entries or leave a torn file. An unreadable or
corrupt file gives one warning and counts as empty; a failed write gives one warning; the job
trains on either way.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time

from coc_inject import log

VERSION = 1


def _as_text(times_ms: dict) -> dict:
    """{candidate: ms} as JSON keeps it: candidates as text, times to 0.1 µs."""
    return {str(c): round(t, 4) for c, t in times_ms.items()}


class TuneCache:
    def __init__(self, path: str):
        self.path = path
        self._entries: dict | None = None

    @staticmethod
    def key(decision_key, identity: str) -> str:
        return json.dumps([*decision_key.cache_fields(), identity])

    def get(self, key: str) -> int | str | None:
        """The cached chunk count (an int >= 1) or named choice (a non-empty str); None otherwise."""
        if self._entries is None:
            self._entries = self._read(warn=True)
        entry = self._entries.get(key)
        if not isinstance(entry, dict):
            return None
        chunks, choice = entry.get("chunks"), entry.get("choice")
        if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
            return chunks
        return choice if isinstance(choice, str) and choice else None

    def confirmed(self, key: str) -> bool:
        """Whether the entry holds a second round's times (entries written before the confirmation
        round existed, or by a decision without one, do not)."""
        entry = self._entries.get(key) if self._entries is not None else None
        return isinstance(entry, dict) and isinstance(entry.get("confirmation_ms"), dict)

    def put(self, key: str, choice: int | str, times_ms: dict, confirmation_ms: dict | None = None) -> None:
        entry = {"choice" if isinstance(choice, str) else "chunks": choice, "times_ms": _as_text(times_ms),
                 "written": round(time.time(), 3)}
        if confirmation_ms:
            entry["confirmation_ms"] = _as_text(confirmation_ms)
        if self._entries is None:
            self._entries = {}
        self._entries[key] = entry
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path + ".lock", "a") as lock:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
                entries = self._read(warn=False)
                entries[key] = entry
                self._write(entries)
        except Exception as error:  # never stop training for the cache
            log.once(("tune-cache-write", self.path), logging.WARNING,
                     f"cannot write the tune cache {self.path} (COC_TUNE_CACHE): {error}; decisions are kept "
                     "for this run only")

    def _read(self, warn: bool) -> dict:
        try:
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
            if not (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("entries"), dict)):
                raise ValueError(f"not a version-{VERSION} coc-inject tune cache")
            return dict(data["entries"])
        except FileNotFoundError:
            return {}
        except Exception as error:
            if warn:
                log.once(("tune-cache-read", self.path), logging.WARNING,
                         f"the tune cache {self.path} (COC_TUNE_CACHE) is unreadable or corrupt ({error}); "
                         "treated as empty, it is rewritten with new decisions")
            return {}

    def _write(self, entries: dict) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, temporary = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"version": VERSION, "entries": entries}, handle, indent=1, sort_keys=True)
                handle.write("\n")
            os.replace(temporary, self.path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise

    def entries(self) -> dict:
        return self._read(warn=True)
