"""Inside copies, a collective's wait is where the copies take turns.

While copies run, the ``torch.distributed`` collectives (and Megatron's module-level aliases of
them, bound at its import) are replaced by wrappers (:data:`INTERCEPTION`, entered around each copy
run only). Outside a copy a wrapper calls the original at once (another thread meanwhile). Inside
one, the collective is started asynchronously and the copies' run decides what
its wait does:

- the forward's copies on threads (scheduler.CopyRun): the wait hands the baton to the next copy
  first, which computes while this copy's collective is in flight (scheduler.HandOverWork);
- the backward from one thread (segments.Segmented): in the node right after a cut, the
  collective of the cut's kind is left in flight (:class:`DeferredWork`) until the copy's next
  turn; every other wait is a wait.

The backward also issues a sequence-parallel column linear's re-gather of its input ahead, at the
start of the copy's band (:class:`Gathered`); the linear's own all-gather of that input is then
served from it and issues nothing.

Either way every collective is issued at a program point of one copy: the same order on every rank."""

from __future__ import annotations

import contextlib
import inspect

from coc_inject import copy_context, dist_interception
from coc_inject.multi_copy.cuts import KINDS

_poison = False  # inside poisoned() only


@contextlib.contextmanager
def poisoned():
    """Tests only, inside: a deferred collective's output reads NaN until its wait (a read before it,
    which on a device would race the network, fails the exactness tests instead of passing by luck on
    CPU). The previous setting comes back on the way out, also after an error."""
    global _poison
    before, _poison = _poison, True
    try:
        yield
    finally:
        _poison = before


class DeferredWork:
    """A collective left in flight past its node: ``wait()`` there does nothing; the copy's run
    completes it (:meth:`complete`) before the copy's next segment reads its output."""

    def __init__(self, work, poisoned=None):
        self._work, self._poisoned = work, poisoned  # poisoned: (the caller's outputs, the private ones)

    def wait(self, *args, **kwargs):
        return True

    def complete(self) -> None:
        self._work.wait()
        if self._poisoned is not None:
            for output, private in zip(*self._poisoned):
                output.copy_(private)


class Gathered:
    """An all-gather of ``tensor`` over ``group`` issued ahead of its caller (segments.py: at the start
    of the copy's band that holds the column linear re-gathering its saved input); :meth:`serve`
    hands it to that caller's own all-gather of the same input, which issues nothing."""

    def __init__(self, tensor, group):
        import torch.distributed as dist

        self.input, self.group = tensor, group
        self.output = tensor.new_empty((tensor.shape[0] * dist.get_world_size(group), *tensor.shape[1:]))
        self._work = dist.all_gather_into_tensor(self.output, tensor, group=group, async_op=True)

    def matches(self, output, tensor, group) -> bool:
        return (group is self.group and tensor.data_ptr() == self.input.data_ptr() and tensor.dtype == self.input.dtype
                and tensor.shape == self.input.shape and output.shape == self.output.shape)

    def complete(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def serve(self, output) -> "_Served":
        if _poison:  # the caller's buffer reads NaN until its wait
            output.fill_(float("nan"))
        return _Served(self, output)


class _Served:
    """The caller's handle on a :class:`Gathered`: its wait completes the gather into the caller's output."""

    def __init__(self, gathered, output):
        self._gathered, self._output = gathered, output

    def wait(self, *args, **kwargs):
        self._gathered.complete()
        self._output.copy_(self._gathered.output)
        return True


def _served(run, args, kwargs):
    """The handle of a :class:`Gathered` the copies' run holds for this all-gather, or None."""
    serve = getattr(run, "serve", None)
    if serve is None or len(args) + len(kwargs) < 2:
        return None
    output = args[0] if args else kwargs.get("output_tensor")
    tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor")
    group = args[2] if len(args) > 2 else kwargs.get("group")
    return serve(output, tensor, group)


def _deferred(original, args, kwargs, output_name):
    """Start ``original`` left in flight; :func:`poisoned`: into private outputs, the caller's NaN meanwhile."""
    if not _poison:
        work = original(*args, **kwargs)
        return None if work is None else DeferredWork(work)
    in_args = bool(args)
    output = args[0] if in_args else kwargs[output_name]
    outputs = list(output) if isinstance(output, (list, tuple)) else [output]
    privates = [tensor.clone() for tensor in outputs]  # all_reduce reads its output: keep its values
    swapped = type(output)(privates) if isinstance(output, (list, tuple)) else privates[0]
    if in_args:
        args = (swapped,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, **{output_name: swapped})
    work = original(*args, **kwargs)
    if work is None:
        return None
    for tensor in outputs:
        tensor.fill_(float("nan"))
    return DeferredWork(work, (outputs, privates))


def wrap(original):
    """``original`` with its waits decided by the copies' run inside copies."""
    try:
        parameters = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        parameters = []
    async_index = dist_interception.async_op_index(original)  # None: by keyword only (another tool's wrapper)
    name = getattr(inspect.unwrap(original), "__name__", "")
    kind = KINDS.get(name)
    # one output tensor: may be gathered ahead (the chunked linears' all_gather_single included)
    served = name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single")
    output_name = parameters[0] if parameters else None

    def collective(*args, **kwargs):
        run = copy_context.current()
        if run is None:
            return original(*args, **kwargs)
        wants_handle, args, kwargs = dist_interception.made_async(async_index, args, kwargs)
        work = _served(run, args, kwargs) if served else None  # gathered ahead: nothing to issue
        if work is None and run.defers(kind):
            work = _deferred(original, args, kwargs, output_name)
            if work is not None:
                run.hold(work)
        elif work is None:
            work = original(*args, **kwargs)
            work = None if work is None else run.handle(work)
        if work is None:  # e.g. a rank outside the group: nothing was issued
            return None
        if wants_handle:
            return work
        work.wait()
        return None

    collective.__wrapped__ = original
    collective.__name__ = getattr(original, "__name__", "collective")
    return collective


def wrap_batch(original):
    def batch_isend_irecv(p2p_op_list):
        works = original(p2p_op_list)
        run = copy_context.current()
        return works if run is None else [run.handle(work) for work in works]

    batch_isend_irecv.__wrapped__ = original
    return batch_isend_irecv


def _wrapping(name, original):
    wrapper = _wrappers.get(original)
    if wrapper is None:  # made once per function: reading a signature is slow
        wrapper = _wrappers[original] = wrap_batch(original) if name == "batch_isend_irecv" else wrap(original)
    return wrapper


_wrappers: dict = {}
# Entered around every copy run (block.py: the forward's copies, the backward's call); outside copy
# runs torch.distributed is left untouched.
INTERCEPTION = dist_interception.Shared(_wrapping)
