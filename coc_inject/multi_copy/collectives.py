"""The network waits of a copy become hand-overs of the baton.

While copies run, the ``torch.distributed`` collectives (and Megatron's module-level aliases of
them, bound at its import) are replaced by wrappers. Outside a copy thread a wrapper calls the
original at once. Inside one:

- a collective the caller waits for (``async_op=False``) is started asynchronously, the baton
  goes to the next copy, and the copy waits for it when the baton comes back;
- a collective started asynchronously returns a handle whose ``wait()`` does the same.

So a copy never blocks on the network while another copy could compute, and every collective
is issued at a program point of one copy: the same order on every rank.
"""

from __future__ import annotations

import inspect

from coc_inject import copy_context

# torch.distributed functions with an ``async_op`` parameter that Megatron's layers and
# coc-inject's engines call; point-to-point ops go through batch_isend_irecv (always async).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all", "broadcast")
# Megatron binds these at import: module -> names holding a torch.distributed collective.
MEGATRON_ALIASES = {
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
}


class HandOverWork:
    """A collective's handle whose wait lets the other copies run first."""

    def __init__(self, work, run):
        self._work, self._run = work, run

    def wait(self, *args, **kwargs):
        # Always, even when the work is already done: whether it is done is timing, which differs
        # between ranks, and the hand-overs decide the order of the next collectives.
        self._run.hand_over()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def wrap(original, observe=None):
    """``original`` with its waits turned into hand-overs inside copies."""
    try:
        async_index = list(inspect.signature(original).parameters).index("async_op")
    except (TypeError, ValueError):
        async_index = None

    def collective(*args, **kwargs):
        run = copy_context.current()
        if run is None:
            return original(*args, **kwargs)
        if async_index is not None and len(args) > async_index:
            wants_handle = bool(args[async_index])
            args = args[:async_index] + (True,) + args[async_index + 1:]
        else:
            wants_handle = bool(kwargs.get("async_op", False))
            kwargs["async_op"] = True
        work = original(*args, **kwargs)
        if work is None:  # e.g. a rank outside the group: nothing was issued
            return None
        if wants_handle:
            return HandOverWork(work, run)
        HandOverWork(work, run).wait()
        return None

    collective.__wrapped__ = original
    collective.__name__ = getattr(original, "__name__", "collective")
    return collective


def wrap_batch(original):
    def batch_isend_irecv(p2p_op_list):
        works = original(p2p_op_list)
        run = copy_context.current()
        return works if run is None else [HandOverWork(work, run) for work in works]

    batch_isend_irecv.__wrapped__ = original
    return batch_isend_irecv
