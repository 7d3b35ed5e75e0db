"""Deciding settings from measurements inside a job: the online tuner of every ``auto`` (online.py)
and the cache of its decisions (cache.py). ``coc-inject tune`` (coc_inject.tune) makes the same
decisions ahead of a job. Importing this package imports nothing."""
