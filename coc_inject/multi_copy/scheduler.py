"""Copies of a computation taking turns on one device: the baton.

Each copy runs in its own thread, but only the holder of the baton runs; a copy hands the
baton on exactly where it would wait for the network (a collective it must wait for), so that
the other copy computes while that collective is in flight. The hand-over points are program
points of the copies themselves, so the interleaving -- and with it the order in which every
collective is issued -- is the same on every rank: copy 0's first collective, copy 1's first,
copy 0's second, ... (MindSpore's comm0(i) -> comm1(i) -> comm0(i+1)), by construction, not by
a scheduler's whim.

What a copy sees as global state that another copy could change between its turns (the RNG
states) is saved when it hands the baton on and restored when it takes it back
(``switch_hooks``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import queue
import threading
from typing import Callable, Sequence

from coc_inject import copy_context
from coc_inject.routes import AS_SET, Inner

_ABSENT = object()  # a copy not yet at a meeting


class _Meeting:
    """One meeting of the copies: each copy's value (``_ABSENT`` until it arrives), and how many have left."""

    __slots__ = ("slots", "left")

    def __init__(self, n: int):
        self.slots = [_ABSENT] * n
        self.left = 0


class CopyAborted(RuntimeError):
    """Another copy failed: this one stops at its next hand-over."""


class Copies:
    """What the code inside a copy reads of its run (copy_context.current()): the copy count, whether
    CoC chunks its linears, whether hand-overs are suspended, and what a collective's wait does
    (collectives.py)."""

    def __init__(self, n: int, inner: Inner = AS_SET):
        self.n = n
        self.inner = inner
        self.alone = 0  # > 0: hand-overs are suspended (alone())
        self.cuts = None  # a forward recording its cut points: one list per copy (cuts.mark)

    def defers(self, kind) -> bool:
        """Is a collective of ``kind`` issued now left in flight past its caller's wait?"""
        return False

    def handle(self, work):
        """The handle the caller of a collective gets for ``work``."""
        return work

    def hand_over(self) -> None:
        return None

    def complete(self, copy) -> None:
        """Wait for ``copy``'s collectives left in flight (a cut's backward reaching them)."""
        return None

    def running_copy(self) -> int | None:
        """The copy the calling code runs as: here its thread's (the backward's run overrides it)."""
        return copy_context.current_copy()

    def meet(self, key, value) -> list | None:
        """Every copy's ``value`` at the program point ``key`` (CopyRun.meet); None: copies cannot meet here."""
        return None


def current_copy() -> int | None:
    """The copy the calling code runs as, None outside copies: the copy thread's in the forward, the
    running autograd node's in the copies' backward (segments.Segmented.running_copy)."""
    run = copy_context.current()
    return None if run is None else run.running_copy()


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


class CopyRun(Copies):
    """One round of ``n`` copies taking turns; :meth:`run` returns each copy's result in order."""

    def __init__(self, n: int, save: Callable[[], object] | None = None, restore: Callable[[object], None] | None = None,
                 inner: Inner = AS_SET):
        super().__init__(n, inner)
        self._save, self._restore = save, restore
        self._turn = 0
        self._done = [False] * n
        self._failed: BaseException | None = None
        self._cond = threading.Condition()
        self._saved: list = [None] * n
        self._meetings: dict = {}  # (key, arrival) -> _Meeting
        self._arrivals: list = [{} for _ in range(n)]  # per copy: key -> how often it reached it

    # -- inside a copy ------------------------------------------------------------------------

    def handle(self, work):
        return HandOverWork(work, self)

    def hand_over(self) -> None:
        """The calling copy is about to wait for the network: let the next copy run meanwhile."""
        index = copy_context.current_copy()
        nxt = self._next_after(index)
        if nxt == index or self.alone:
            return
        self._switch(index, nxt)

    def meet(self, key, value) -> list:
        """Every copy's ``value`` at the program point ``key``: the calling copy hands the baton on until
        all have reached it, and they leave in copy order, copy 0 first, so their turns go on as before
        the meeting (a program point of every copy: the same order on every rank). A copy may reach
        ``key`` more than once (megatron-core 0.19's mlp_chunks_for_training calls an MoE layer once per
        chunk): its i-th arrival meets the other copies' i-th, and a meeting is dropped once every copy
        has left it. An MoE router's batch aux loss combines the copies' token counts here."""
        index = copy_context.current_copy()
        arrivals = self._arrivals[index]
        occurrence = arrivals.get(key, 0)
        arrivals[key] = occurrence + 1
        meeting = self._meetings.setdefault((key, occurrence), _Meeting(self.n))
        meeting.slots[index] = value
        while meeting.left < index or any(slot is _ABSENT for slot in meeting.slots):
            nxt = self._next_after(index)
            if nxt == index or self.alone:
                raise RuntimeError(f"multi-copy: copy {index} waits at {key!r} (arrival {occurrence + 1}) for a "
                                   "copy that cannot come")
            self._switch(index, nxt)
        meeting.left = index + 1
        if meeting.left == self.n:  # the last copy out: the next arrival at ``key`` is a new meeting
            del self._meetings[(key, occurrence)]
        return list(meeting.slots)

    def _next_after(self, index: int) -> int:
        for step in range(1, self.n + 1):
            other = (index + step) % self.n
            if not self._done[other]:
                return other
        return index

    def _switch(self, index: int, nxt: int) -> None:
        if self._save is not None:
            self._saved[index] = self._save()
        with self._cond:
            self._turn = nxt
            self._cond.notify_all()
        self._take_turn(index)

    def _take_turn(self, index: int) -> None:
        """Wait until it is ``index``'s turn, then put back what that copy saw last."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == index or self._failed is not None)
            if self._failed is not None:
                raise CopyAborted("another copy failed")
        if self._restore is not None:
            self._restore(self._saved[index])

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()

    # -- the caller ---------------------------------------------------------------------------

    def run(self, work: Sequence[Callable[[], object]]) -> list:
        assert len(work) == self.n
        results: list = [None] * self.n
        context = ThreadContext()
        first_state = self._save() if self._save is not None else None
        self._saved = [first_state] * self.n

        def body(index: int) -> None:
            copy_context.enter(self, index)
            entered = False
            try:
                try:
                    context.enter()
                    entered = True
                    self._take_turn(index)
                    results[index] = work[index]()
                finally:
                    if self._save is not None:
                        self._saved[index] = self._save()
                    if entered:
                        context.exit()
            except CopyAborted:
                pass
            except BaseException as error:  # the first failure stops every copy
                self._fail(error)
            finally:  # whatever failed: the caller must hear that this copy is done
                copy_context.leave()
                with self._cond:
                    self._done[index] = True
                    nxt = self._next_after(index)
                    if nxt != index:
                        self._turn = nxt
                    self._cond.notify_all()

        # Each copy runs in a copy of the caller's context variables: torch keeps its config's
        # overrides in them (torch._dynamo.config.disable = True in the caller: the copies'
        # torch.compile'd helpers would compile in a new thread's context).
        contexts = [contextvars.copy_context() for _ in range(self.n)]
        with _pool.lent(self.n) as workers:
            for index, worker in enumerate(workers):
                worker.start(functools.partial(contexts[index].run, body, index))
            with self._cond:
                self._cond.wait_for(lambda: all(self._done))
        if self._failed is not None:
            raise self._failed
        if self._restore is not None:  # the caller goes on from copy 0's state
            self._restore(self._saved[0])
        return results


class _Worker:
    """A thread that runs one copy at a time, kept between runs: what the C libraries keep per
    thread -- above all the allocator's arena, whose memory a new thread would fault in page by
    page again at every block call -- stays warm."""

    def __init__(self, name: str, once: bool = False):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._once = once
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def start(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
            if self._once:
                return


class _Pool:
    """The process's copy threads. A run started while they are busy (a run inside a copy, or in
    another thread) gets threads of its own, used once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._workers: list = []

    @contextlib.contextmanager
    def lent(self, n: int):
        if not self._lock.acquire(blocking=False):
            yield [_Worker(f"coc-copy-{i}-once", once=True) for i in range(n)]
            return
        try:
            while len(self._workers) < n:
                self._workers.append(_Worker(f"coc-copy-{len(self._workers)}"))
            yield self._workers[:n]
        finally:
            self._lock.release()

    def forget(self) -> None:
        """In a forked child: the parent's threads are not there."""
        self.__init__()


_pool = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.forget)





class ThreadContext:
    """What torch keeps per thread and a copy must see as its caller does: grad mode, the
    saved-tensor hooks (activation offloading, memory accounting), autocast, each accelerator's
    device and current stream (a new thread would start on device 0's default stream)."""

    def __init__(self):
        import torch

        from coc_inject.rng_state import accelerators

        self.grad = torch.is_grad_enabled()
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # older torch: none to read
        self.hooks = top(False) if top is not None else None  # (forward.py refuses a call under hooks there)
        in_use = accelerators()
        self.autocast = {}
        for device in ("cpu", "cuda", *(name for name, _ in in_use if name != "cuda")):
            try:
                self.autocast[device] = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            except RuntimeError:  # a device type this torch cannot autocast
                continue
        self.streams = [(module, module.current_stream()) for _, module in in_use]

    def enter(self) -> None:
        import torch

        torch.set_grad_enabled(self.grad)
        if self.hooks is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self.hooks)
        for device, (enabled, dtype) in self.autocast.items():  # a kept thread has the last run's
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        for module, stream in self.streams:
            module.set_device(stream.device_index)
            module.set_stream(stream)

    def exit(self) -> None:
        import torch

        if self.hooks is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
