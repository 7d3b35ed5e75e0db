"""COC_MEASURE: how much communication each wing hid, measured in the user's own job.

The flow: ``install.py`` (the hook: with COC_MEASURE or COC_TRACE, every ``torch.distributed``
collective of the job is wrapped, through the installation's patches) -> ``metered.py`` (a
collective's issue and every wait on it, timed: the host clock on CPU ranks, device events on
CUDA / NPU, ``clocks.py``) -> ``records.py`` (one :class:`~records.Collective` per call, its wing,
group, layer and phase from ``attribution.py`` and ``layers.py``) -> ``exposure.py`` (steps cut at
the optimizer's step, the records resolved without a host sync and summed per wing, collective and
layer: the summary lines, the warnings, COC_REPORT's ``communication``, the trace's timeline).

Nothing of it is imported or runs when neither setting is given.
"""
