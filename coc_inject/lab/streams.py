"""Where a lab collective runs: its own stream, the caller's stream waiting on it as NCCL/HCCL make it.

One :class:`Lane` per process group (NCCL: one stream per communicator) runs the group's transfers in
issue order. A transfer is a job: hold the link for its time, then write its outputs (so a reader
that did not wait reads the buffer before it arrives, as on a device). The lane is written once,
over a small stream interface that two classes give:

* :class:`ThreadStreams` (CPU): the caller's work is done when it calls (eager), so a transfer needs
  nothing to start after; the side stream is a worker thread; waiting blocks the calling thread.
* :class:`CudaStreams`: the side stream waits on an event recorded on the caller's current stream at
  the call (NCCL's stream dependency), runs the spin kernel that holds the link time, the copy that
  loads device memory, and the output writes; its end event is what ``wait`` makes the *current*
  stream (at wait time) wait on, with no host sync. Tensors the side stream touches are recorded on
  it (the caching allocator does not hand their memory to the caller's stream while it runs).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

WAIT_LIMIT_S = 300.0  # a transfer never takes this long: past it the lab stops with an error, never hangs


class LabTimeout(RuntimeError):
    pass


class ThreadStreams:
    """The CPU's streams: a worker thread a lane."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="coc-lab-stream", daemon=True)
        self._thread.start()

    def _work(self):
        while True:
            job, done = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as error:  # said at the wait, on the caller's thread
                done.error = error
            done.set()

    def mark(self):
        return None  # the caller's work so far has run already

    def launch(self, job, after, tensors):
        done = threading.Event()
        done.error = None
        self._jobs.put((job, done))
        return done

    def hold(self, seconds: float, moved: int) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, done) -> None:
        if not done.wait(WAIT_LIMIT_S):
            raise LabTimeout(f"a lab collective did not finish within {WAIT_LIMIT_S:g} s")
        if done.error is not None:
            raise RuntimeError(f"a lab collective failed on its stream: {done.error!r}") from done.error

    def done(self, done) -> bool:
        return done.is_set()

    def close(self) -> None:
        self._jobs.put((None, None))
        self._thread.join(timeout=WAIT_LIMIT_S)


class CudaStreams:
    """A CUDA side stream a lane (module docstring). ``cuda`` is torch.cuda (a test may hand in a
    recorder of the calls: the contract is the order of events, waits and records)."""

    def __init__(self, device, cuda=None, calibrate: bool = True):
        self.cuda = cuda or torch.cuda
        self.device = torch.device(device)
        self.side = self.cuda.Stream(device=self.device)
        self._scratch = None
        if not calibrate:
            self.cycles_per_s, self.copy_bytes_per_s = 1.4e9, 1e12
        else:  # once a device: Megatron makes a score of groups, each a lane
            key = str(self.device)
            if key not in _CALIBRATED:
                _CALIBRATED[key] = _calibrate(self)
            self.cycles_per_s, self.copy_bytes_per_s = _CALIBRATED[key]

    def mark(self):
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(self.device))
        return event

    def launch(self, job, after, tensors):
        self.side.wait_event(after)  # the transfer starts after the caller's work issued so far
        with self.cuda.stream(self.side):
            job()
            done = self.cuda.Event()
            done.record(self.side)
        for tensor in tensors:
            tensor.record_stream(self.side)
        return done

    def hold(self, seconds: float, moved: int) -> None:
        """On the side stream: ``moved`` bytes through device memory (the link's share of the transfer's),
        then a spin for the rest of its time (the spin kernel is one block; NCCL's channels occupy more SMs)."""
        moved = moved // 2 * 2
        if moved:
            if self._scratch is None or self._scratch.numel() < moved:
                self._scratch = torch.empty(moved, dtype=torch.uint8, device=self.device)
            half = moved // 2
            self._scratch[half:moved].copy_(self._scratch[:half])
            seconds -= moved / self.copy_bytes_per_s
        if seconds > 0:
            self.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))

    def wait(self, done) -> None:
        self.cuda.current_stream(self.device).wait_event(done)

    def done(self, done) -> bool:
        return done.query()

    def close(self) -> None:
        self.side.synchronize()


_CALIBRATED: dict = {}  # device -> (spin cycles a second, copy bytes a second)


def _calibrate(streams: CudaStreams) -> tuple[float, float]:
    """Spin cycles a second and copy bytes a second on this device, timed by events on the side stream."""
    cuda, cycles, size = streams.cuda, 20_000_000, 256 << 20
    buffer = torch.empty(size, dtype=torch.uint8, device=streams.device)
    with cuda.stream(streams.side):
        cuda._sleep(1000)
        begin, middle, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        begin.record(streams.side)
        cuda._sleep(cycles)
        middle.record(streams.side)
        buffer[size // 2:].copy_(buffer[:size // 2])
        end.record(streams.side)
    end.synchronize()
    return cycles / (begin.elapsed_time(middle) / 1e3), size / (middle.elapsed_time(end) / 1e3)


class Lane:
    """One group's transfers, in issue order, on its own stream."""

    def __init__(self, streams):
        self.streams = streams

    def submit(self, seconds: float, moved: int, move, tensors) -> object:
        """A transfer of ``seconds`` moving ``moved`` bytes through device memory, then ``move()`` writing its outputs."""
        after = self.streams.mark()

        def job():
            self.streams.hold(seconds, moved)
            with torch.no_grad():
                move()
        return self.streams.launch(job, after, tensors)
