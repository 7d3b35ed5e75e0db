"""``coc-inject tune``: the ``auto`` settings' decisions made ahead of a job, into the tune cache
(coc_inject.tuning.cache), by the wings' own online tuner on the real megatron-core layers: the
command (run.py), its attention and MoE shapes (attention.py, moe.py) and what it prints (report.py).
Importing this package imports nothing (tune's argument errors come without torch)."""
