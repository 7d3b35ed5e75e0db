"""An emulated slow interconnect between two ranks on one machine (root only).

Two network namespaces joined by a veth pair with a token-bucket rate limit (``tc tbf``) on
both ends: traffic between the ranks then costs mostly wire time, as on a real link, instead
of burning the same CPU cores the matmuls need (plain loopback). Each rank process enters its
namespace with ``setns(2)`` and is pinned to its own core. Only ``tbf``/``htb`` exist in these
kernels: no latency emulation.

Teardown is guaranteed: on normal exit, on exceptions, on Ctrl-C / SIGTERM, and at
interpreter exit.

The other end of the scale, :func:`no_collectives`: an infinitely fast network (every collective a
no-op), for the compute-only twin of a measured layer.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess

CLONE_NEWNET = 0x40000000
INTERFACE = "cocl"
SUBNET = "10.77.0"


class LinkError(RuntimeError):
    pass


def _ip(*args, check=True):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LinkError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


class EmulatedLink:
    """``with EmulatedLink("1gbit") as link:`` -> ``link.namespace(rank)``, ``link.address(rank)``."""

    def __init__(self, rate: str = "1gbit", ranks: int = 2, burst: str = "256kb", limit: str = "16mb"):
        if ranks != 2:
            raise LinkError(f"--link emulates a point-to-point link: ranks={ranks} is invalid, expected 2")
        self.rate, self.burst, self.limit = rate, burst, limit
        self.names = [f"coc{os.getpid()}r{rank}" for rank in range(ranks)]
        self._up = False
        self._previous_handlers = {}

    @staticmethod
    def check_available() -> None:
        if os.geteuid() != 0:
            raise LinkError("--link needs root (network namespaces and tc); run as root, "
                            "or benchmark over plain loopback without --link")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise LinkError(f"--link needs {' and '.join(missing)} (Debian package iproute2)")

    def namespace(self, rank: int) -> str:
        return self.names[rank]

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self):
        self.check_available()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        atexit.register(self.teardown)
        self._up = True
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("link", "add", INTERFACE, "netns", self.names[0], "type", "veth",
                "peer", "name", INTERFACE, "netns", self.names[1])
            for rank, name in enumerate(self.names):
                _ip("-n", name, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
                _ip("-n", name, "link", "set", INTERFACE, "up")
                proc = subprocess.run(["tc", "-n", name, "qdisc", "replace", "dev", INTERFACE, "root", "tbf",
                                       "rate", self.rate, "burst", self.burst, "limit", self.limit],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise LinkError(f"tc rate limit {self.rate!r} failed: {proc.stderr.strip()}")
        except BaseException:
            self.teardown()
            raise
        return self

    def _on_signal(self, signum, frame):
        self.teardown()
        raise KeyboardInterrupt(f"signal {signum}")

    def teardown(self) -> None:
        if not self._up:
            return
        self._up = False
        for name in self.names:
            _ip("netns", "del", name, check=False)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        atexit.unregister(self.teardown)

    def __exit__(self, *exc):
        self.teardown()
        return False


def enter(namespace: str, core: int | None) -> None:
    """Move the calling process into ``namespace`` (before it opens any socket) and pin it."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            raise LinkError(f"setns into {namespace} failed: {os.strerror(ctypes.get_errno())}")
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core % os.cpu_count()})


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def no_collectives(only=None):
    """The compute-only twin: every collective (torch's and Megatron's aliases of them; or those named
    in ``only``) a no-op that zero-fills its output -- the same layer on an infinitely fast network. An
    integer collective still runs (the MoE dispatcher's token counts: the routing, not the traffic)."""
    from coc_inject import dist_interception

    def no_op(original, zero_fill):
        def call(*args, async_op=False, **kwargs):  # (output, input, ...) or ([outputs], input, ...)
            output = args[0] if args else next(iter(kwargs.values()))
            tensors = output if isinstance(output, list) else [output]
            if not tensors[0].is_floating_point():
                return original(*args, async_op=async_op, **kwargs)
            for tensor in tensors if zero_fill else ():  # all_reduce: the tensor already holds a result
                tensor.zero_()
            return _Done() if async_op else None
        return call

    # every collective of the one list (dist_interception) but these, which run for real (the list forms,
    # broadcasts and point-to-point: none of Megatron's layers' floating-point traffic)
    kept = ("broadcast", "batch_isend_irecv", "all_to_all", "reduce_scatter")
    names = tuple(name for name in dist_interception.EVERY_COLLECTIVE if name not in kept)
    return dist_interception.replaced(
        lambda name, original: no_op(original, name != "all_reduce") if only is None or name in only else None, names)
