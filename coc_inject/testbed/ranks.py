"""Where the ranks of ``coc-inject bench``, ``tune``, ``selftest`` and ``make bench-flash`` run.

A few local CPU processes over gloo, forked from one server that imported torch once (plain loopback, or the emulated link of
coc_inject.testbed.link), or, under torchrun, this process on its rank's device. A frozen
:class:`Setup` says where and how; a run's work is ``work(payload, device)`` with a payload of
its own that the launcher only carries. Megatron's parallel state is initialised here for the
bench and tune. Nothing here writes to the caller's arguments or, for good, to its environment.

Stdlib only at import (the CLI's ``--help`` and argument errors must not import torch).
"""

from __future__ import annotations

import os
import platform
import socket
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

from coc_inject import log
from coc_inject.testbed import link as link_module

COC_PREFIXES = ("COC_", "USE_COC_")
LINK_PORT = 29500  # the rendezvous port on the emulated link's own address: any port is free there


@dataclass(frozen=True)
class Setup:
    """Where and how one run's ranks start: ``world`` local ranks (under torchrun: the job's),
    over an emulated ``link`` of that rate (None: plain loopback), ``threads`` torch threads per
    local CPU rank; Megatron's parallel state with TP ``tp`` (None: the whole world) and CP ``cp``
    unless ``megatron`` is False (work that never touches Megatron skips its import); ``command``
    names the run in its failure."""

    world: int = 2
    link: str | None = None
    threads: int = 1
    tp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert TP (None: Megatron's default, the TP size)
    megatron: bool = True
    command: str = "coc-inject bench"
    device_variable: str = "COC_BENCH_DEVICE"  # under torchrun, "npu" in it picks the Ascend NPU
    # Local ranks spawned anew instead of forked from the server: a memory measurement inherits no
    # page of the server's (a forked rank's resident set starts from the server's).
    fresh: bool = False


def under_torchrun() -> bool:
    return "RANK" in os.environ


STARTUP_ATTEMPTS = 3  # on_a_free_port's tries
AFTER_A_FAILURE_S = 5.0  # how long the other ranks' answers are awaited once one rank failed


class AnswerWait:
    """How long the ranks' remaining answers are still awaited: until ``timeout`` (None: without end) and,
    once one rank failed, AFTER_A_FAILURE_S past that failure at most (its peers are likely blocked on it).
    The one rule of the bench's local ranks (a queue, :func:`run_local_ranks`) and the tests' rank pool (pipes)."""

    def __init__(self, timeout: float | None = None):
        self._until = float("inf") if timeout is None else time.monotonic() + timeout
        self.failed = False

    def failure(self) -> None:
        if not self.failed:
            self.failed = True
            self._until = min(self._until, time.monotonic() + AFTER_A_FAILURE_S)

    def left(self) -> float | None:
        """Seconds still to await (0: give up on the ranks yet to answer; None: without end, as
        ``connection.wait`` and ``queue.get`` take it -- an infinite float overflows them)."""
        if self._until == float("inf"):
            return None
        return max(0.0, self._until - time.monotonic())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_a_free_port(start):
    """``start(port)`` on a :func:`free_port`; again on another where another process took that port before
    rank 0 listened on it (its RuntimeError names EADDRINUSE; e.g. make test's suites side by side). Any other
    failure is raised as it is."""
    for attempt in range(STARTUP_ATTEMPTS):
        try:
            return start(free_port())
        except RuntimeError as error:
            if "EADDRINUSE" not in str(error) or attempt + 1 == STARTUP_ATTEMPTS:
                raise


@contextmanager
def without_coc_variables():
    """Processes spawned inside start with coc-inject's variables unset (they install what they
    measure themselves); this process's environment is given back as it was on the way out."""
    saved = {key: value for key, value in os.environ.items() if key.startswith(COC_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _entry(worker, rank, world, port, queue, args):
    try:
        queue.put(("ok", worker(rank, world, port, *args)))
    except BaseException:  # report, so the parent never waits forever
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _answers(queue, procs) -> list:
    """Every rank's (status, value); a rank that died without one (killed, crashed before
    _entry: e.g. a script without an ``if __name__ == "__main__"`` guard) stops the run. Once a rank
    reported an error, the others are awaited AFTER_A_FAILURE_S more, then killed (likely blocked on it)."""
    from queue import Empty

    answers, wait = [], AnswerWait()
    while len(answers) < len(procs):
        left = wait.left()
        if left == 0:
            for proc in procs:
                proc.kill()
            break
        try:
            # a second at a time: a dead rank is noticed
            answers.append(queue.get(timeout=1.0 if left is None else min(1.0, left)))
            if answers[-1][0] == "error":
                wait.failure()
        except Empty:
            dead = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead and queue.empty():
                for proc in procs:
                    proc.kill()
                codes = ", ".join(f"rank {rank} exit code {procs[rank].exitcode}" for rank in dead)
                raise RuntimeError(f"a rank process died without reporting ({codes}); its stderr is above")
    return answers


def rank_context():
    """Where local ranks start: forked from one server process that imported torch (and megatron-core,
    where it is installed) once for this process, not each rank importing them anew (seconds of CPU
    per rank, per run). The server starts at the first run, with that run's environment.

    Where an accelerator is visible, the ranks are spawned instead: importing megatron-core there can
    initialise CUDA in the server, and a rank forked from it then fails at its first CUDA call
    ("Cannot re-initialize CUDA in forked subprocess"; seen on an H200 with torch 2.11)."""
    import importlib.util

    import torch.multiprocessing as mp  # torch: only once ranks start

    if accelerator_visible():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed"]
    if importlib.util.find_spec("megatron") is not None:
        preload += ["megatron.core.parallel_state", "megatron.core.tensor_parallel"]
    context.set_forkserver_preload(preload)  # takes effect only before the server's first start
    return context


def accelerator_visible() -> bool:
    """A CUDA or NPU device is present (asked without initialising either in this process)."""
    import torch

    npu = getattr(torch, "npu", None)
    return torch.cuda.is_available() or bool(npu is not None and npu.is_available())


@contextmanager
def _accelerators_hidden():
    """Local ranks are CPU ranks: on a GPU host they start with no CUDA device visible, so that torch
    (dynamo's device checks among them) never reaches the GPU through Megatron's CPU shims."""
    if not accelerator_visible():
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@contextmanager
def _numpy_warning_quiet():
    """Local ranks (and the server they fork from) start without torch's 'Failed to initialize NumPy'
    warning: the filter in PYTHONWARNINGS while they start, this process's value given back after."""
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [saved, log.NUMPY_WARNING_FILTER]))
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = saved


def run_local_ranks(worker, world: int, port: int, *args, fresh: bool = False):
    """Start ``worker(rank, world, port, *args)`` in ``world`` local processes (``fresh``: spawned
    anew, not forked from the server); return the one non-None result (rank 0's). Raises
    RuntimeError with every failing rank's traceback."""
    if fresh:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
    else:
        context = rank_context()
    queue = context.Queue()
    procs = [context.Process(target=_entry, args=(worker, rank, world, port, queue, args))
             for rank in range(world)]
    with _accelerators_hidden(), _numpy_warning_quiet():
        for proc in procs:
            proc.start()
    answers = _answers(queue, procs)
    for proc in procs:
        proc.join()
    errors = [value for status, value in answers if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return next((value for _, value in answers if value is not None), None)


def torchrun_device(npu_variable: str):
    """``(device, backend)`` for this torchrun rank, made current: CUDA with NCCL if present; an
    Ascend NPU with HCCL when ``npu_variable`` is set to "npu" (torch_npu is imported only then:
    without the CANN libraries it breaks ``import torch``); else the CPU with gloo.
    ``npu_variable=cuda-gloo``: CUDA with gloo, ranks sharing the GPUs there are (NCCL refuses two
    ranks on one GPU): the multi-rank cases on real device kernels and streams where fewer GPUs are lent."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if os.environ.get(npu_variable) == "cuda-gloo":
        if not torch.cuda.is_available():
            raise SystemExit(f"{npu_variable}=cuda-gloo: no CUDA device here (it puts the ranks on the GPUs there are)")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "gloo"
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    if os.environ.get(npu_variable) == "npu":
        import torch_npu  # noqa: F401

        device = torch.device("npu", local_rank)
        torch.npu.set_device(device)
        return device, "hccl"
    return torch.device("cpu"), "gloo"


def initialize_megatron(setup: Setup, world: int) -> None:
    """Megatron's parallel state: TP = ``setup.tp`` (default: the whole world), CP = ``setup.cp``,
    EP = ``setup.ep``, expert TP = ``setup.etp``."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=setup.tp or world,
                                             context_parallel_size=setup.cp, expert_model_parallel_size=setup.ep,
                                             expert_tensor_parallel_size=setup.etp)


def point_megatron_at_cpu() -> None:
    import torch

    # Megatron allocates its SP buffers with torch.cuda.current_device(); these ranks are CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _local_rank(rank, world, port, setup: Setup, namespaces, work, payload):
    """One spawned rank: gloo on the CPU (in its namespace of the link, pinned to a core),
    Megatron's parallel state unless ``setup.megatron`` is False; runs ``work(payload, device)``."""
    if namespaces:
        link_module.enter(namespaces[rank], core=rank)
        os.environ["GLOO_SOCKET_IFNAME"] = link_module.INTERFACE
        address = f"{link_module.SUBNET}.1"
    else:
        address = "127.0.0.1"
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(setup.threads)
    point_megatron_at_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if setup.megatron:
        initialize_megatron(setup, world)
    try:
        return work(payload, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def run_local(setup: Setup, work, payload):
    """``work(payload, device)`` on ``setup.world`` local CPU ranks; rank 0's result, or
    SystemExit naming ``setup.command`` with every failing rank's traceback."""
    try:
        with without_coc_variables():  # each run installs what it measures itself
            if setup.link:
                with link_module.EmulatedLink(setup.link) as link:
                    return run_local_ranks(_local_rank, setup.world, LINK_PORT, setup, link.names, work, payload,
                                           fresh=setup.fresh)
            return on_a_free_port(lambda port: run_local_ranks(_local_rank, setup.world, port, setup, None, work,
                                                               payload, fresh=setup.fresh))
    except RuntimeError as error:
        raise SystemExit(f"{setup.command} failed:\n{error}") from None


def run_torchrun(setup: Setup, work, payload):
    """Under torchrun: this process is one rank of the job, on its accelerator; Megatron's parallel
    state as initialize_megatron makes it (unless ``setup.megatron`` is False). Rank 0's result; None on the other ranks."""
    import torch.distributed as dist

    device, backend = torchrun_device(setup.device_variable)
    if device.type == "cpu":
        point_megatron_at_cpu()
    dist.init_process_group(backend)
    if setup.megatron:
        initialize_megatron(setup, dist.get_world_size())
    try:
        return work(payload, device)
    finally:
        dist.destroy_process_group()


def run(setup: Setup, work, payload):
    """Under torchrun on the job's ranks, else on local ones."""
    return run_torchrun(setup, work, payload) if under_torchrun() else run_local(setup, work, payload)


def describe_where(setup: Setup, ranks: str | None = None) -> str:
    """The bench titles' where: torchrun's world, or the local ranks (``ranks``: how to count them,
    default "N local CPU ranks"), their link, threads and this host."""
    if under_torchrun():
        return f"torchrun, {os.environ.get('WORLD_SIZE')} ranks"
    where = (f"emulated {setup.link} link (netns + veth + tbf), ranks pinned to cores" if setup.link
             else "plain loopback")
    return (f"{ranks or f'{setup.world} local CPU ranks'} (gloo), {where}, {setup.threads} thread(s)/rank, "
            f"{platform.node()}")
