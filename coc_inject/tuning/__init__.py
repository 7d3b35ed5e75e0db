"""Deciding settings from measurements: the online tuner of every ``auto`` (online.py), the cache
of its decisions (cache.py), and ``coc-inject tune``, which makes them ahead of a job (offline*.py).
Importing this package imports nothing (tune's argument errors come without torch)."""
