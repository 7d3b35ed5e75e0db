"""The measuring wrappers of ``torch.distributed``'s collectives, and the handle whose waits they time.

A wrapper makes one :class:`~coc_inject.measure.records.Collective` per call while a measured step
runs (otherwise it only calls through): its bytes, who issued it (attribution.py), its layer
(layers.py) and phase, when it was issued; a synchronous call is waited for where it is made (the
whole call: on CPU the rank is blocked; on a device the compute stream waits at once); an
asynchronous one returns a :class:`MeteredWork` whose ``wait()`` is timed. On the host, gloo's future
tells when the network finished. Under ``torch.profiler`` each issue and wait is also a
``record_function`` range named ``coc::<wing>::<op>``.
"""

from __future__ import annotations

import contextlib

from coc_inject import dist_interception, meter
from coc_inject.measure import attribution, clocks
from coc_inject.measure.records import Collective


# One name per operation, whichever of torch's forms issued it (the side-by-side compares Megatron's
# reduce_scatter_tensor with the chunked pipeline's reduce_scatter_single).
OPERATION = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
             "reduce_scatter_single": "reduce_scatter", "all_to_all_single": "all_to_all",
             "batch_isend_irecv": "send/recv"}


def _tensors(args, kwargs):
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif hasattr(item, "tensor"):  # a P2POp
                    yield item.tensor


def _group(name, args, kwargs, group_index):
    """The call's process group wherever the caller put it (``group_index``: its position in the
    collective's signature, dist_interception.parameter_index); None: the world."""
    if "group" in kwargs:
        return kwargs["group"]
    if group_index is not None and len(args) > group_index:
        return args[group_index]
    if name == "batch_isend_irecv" and args and args[0]:
        return getattr(args[0][0], "group", None)
    return None


def _profiled(name: str):
    import torch

    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return None


class MeteredWork:
    """A collective's handle: ``wait()`` timed into its record; anything else is the handle's."""

    def __init__(self, work, record, exposure):
        self._work, self._record, self._exposure = work, record, exposure

    def wait(self, *args, **kwargs):
        record, clock = self._record, self._exposure.clock_of(self._record)
        profiled = _profiled(f"coc::{record.wing}::{record.op}::wait")
        if profiled is not None:
            profiled.__enter__()
        begin = meter.now() if clock is None else clock.mark()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            end = meter.now() if clock is None else clock.mark()
            (record.waits if clock is None else record.marks[1]).append((begin, end))
            if profiled is not None:
                profiled.__exit__(None, None, None)

    def __getattr__(self, name):
        return getattr(self._work, name)


def wrapper(exposure, name: str, original):
    """``original`` (a torch.distributed collective) measured into ``exposure`` while it records."""
    async_index = dist_interception.async_op_index(original)
    group_index = dist_interception.parameter_index(original, "group")  # once per function: signatures are slow

    def metered(*args, **kwargs):
        if not exposure.recording:
            return original(*args, **kwargs)
        if exposure.paused():  # auto's trials: kept apart, the group noted (peers.py); the meter's own: nothing
            if name != "batch_isend_irecv":
                exposure.kept_apart(_group(name, args, kwargs, group_index))
            return original(*args, **kwargs)
        tensors = list(_tensors(args, kwargs))
        device = tensors[0].device.type if tensors else "cpu"
        if device != "cpu" and clocks.capturing(device):  # a graph's capture: its replays are not timed here
            return original(*args, **kwargs)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        wing = attribution.issuer()
        phase = attribution.phase(wing)
        handle = _group(name, args, kwargs, group_index)
        group = exposure.group_name(handle)
        if group in attribution.EXPERT_GROUPS and wing.startswith("megatron"):
            wing = "megatron moe"  # its all-to-all's backward runs in the mappings alone (no MoE frame above)
        record = Collective(wing, OPERATION.get(name, name), group, nbytes,
                            exposure.layers.current(phase == "backward"), phase, None, handle=handle)
        clock = exposure.clock_for(device, record)
        profiled = _profiled(f"coc::{wing}::{record.op}")  # the wait's range names the same op
        if profiled is not None:
            profiled.__enter__()
        try:
            if clock is None:
                record.issued = meter.now()
                result = original(*args, **kwargs)
            else:
                record.marks = (clock.mark(), [], None)
                result = original(*args, **kwargs)
        finally:
            if profiled is not None:
                profiled.__exit__(None, None, None)
        exposure.add(record)
        asynchronous = dist_interception.is_async(async_index, args, kwargs) or name == "batch_isend_irecv"
        if not asynchronous:  # waited for in the call
            if clock is None:
                end = meter.now()
                record.waits.append((record.issued, end))
                record.done = end
            else:
                record.marks[1].append((record.marks[0], clock.mark()))
            return result
        if name == "batch_isend_irecv":
            return [MeteredWork(work, record, exposure) for work in result]
        if result is None:
            return result
        if clock is None:
            _when_done(result, record)
        return MeteredWork(result, record, exposure)

    metered.__wrapped__ = original
    metered.__name__ = getattr(original, "__name__", name)
    return metered


def _when_done(work, record) -> None:
    try:
        future = work.get_future()
        future.add_done_callback
    except Exception:  # noqa: BLE001 - a backend without futures, a coalesced op's placeholder: done = the last wait's end
        return

    def finished(_):
        record.done = meter.now()

    future.add_done_callback(finished)


class _BatchWork:
    """A coalesced batch's handle (the manager's ``works``): its wait timed once for the whole batch."""

    def __init__(self, work, batch, exposure):
        self._work, self._batch, self._exposure = work, batch, exposure

    def wait(self, *args, **kwargs):
        begin = meter.now()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            _batch_waited(self._batch, begin, meter.now())

    def __getattr__(self, name):
        return getattr(self._work, name)


def _batch_waited(batch, begin, end) -> None:
    """A coalesced batch goes out and is waited for as one: the wait is its first collective's, and every
    one of them is done at its end (the per-group queue then charges the batch its span once)."""
    if batch:
        batch[0].waits.append((begin, end))
        for record in batch:
            if record.done is None:  # the backend's future, where it told, is the better end
                record.done = end


def coalescing(exposure, original):
    """torch's ``_coalescing_manager`` (Megatron DDP's gradient buckets) measured: the collectives issued
    inside are recorded by their own wrappers, queued, not sent; they go out at the manager's exit, which
    waits for them when ``async_ops`` is false, else ``cm.wait()`` does. Host clock only: on a device the
    batch's records keep their issue and get no wait (said in docs/measuring.md)."""

    @contextlib.contextmanager
    def metered(*args, **kwargs):
        if not exposure.recording or exposure.paused():
            with original(*args, **kwargs) as manager:
                yield manager
            return
        first = exposure.issued
        context = original(*args, **kwargs)
        manager = context.__enter__()
        try:
            yield manager
        except BaseException as error:
            if not context.__exit__(type(error), error, error.__traceback__):
                raise
            return
        batch = [record for record in exposure.issued_since(first) if record.marks is None]
        begin = meter.now()
        context.__exit__(None, None, None)  # sends the batch; waits for it unless async_ops
        end = meter.now()
        if getattr(manager, "works", None):
            manager.works = [_BatchWork(work, batch, exposure) for work in manager.works]
            for work in manager.works:
                for record in batch:
                    _when_done(work._work, record)
        else:
            _batch_waited(batch, begin, end)

    metered.__wrapped__ = original
    return metered
