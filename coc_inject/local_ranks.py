"""Where the bench and selftest ranks run: a few spawned local processes (no torchrun), or,
under torchrun, this process on its rank's device."""

from __future__ import annotations

import os
import socket
import traceback
from contextlib import contextmanager

COC_PREFIXES = ("COC_", "USE_COC_")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def run_local_ranks(worker, world: int, port: int, *args):
    """Start ``worker(rank, world, port, *args)`` in ``world`` spawned processes; return the
    one non-None result (rank 0's). Raises RuntimeError with every failing rank's traceback."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_entry, args=(worker, rank, world, port, queue, args))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    answers = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    errors = [value for status, value in answers if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return next((value for _, value in answers if value is not None), None)


def torchrun_device(npu_variable: str):
    """``(device, backend)`` for this torchrun rank, made current: CUDA with NCCL if present; an
    Ascend NPU with HCCL when ``npu_variable`` is set to "npu" (torch_npu is imported only then:
    without the CANN libraries it breaks ``import torch``); else the CPU with gloo."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
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
