"""A pool of real torch.distributed (gloo) worker processes, started once per test module (forked
from one server that has imported torch and megatron-core once per test session).

Each worker imports the real megatron-core, joins a gloo group and initialises Megatron's
model-parallel state with TP = world size. Tests send a function (by ``module:name``) to
every rank and get each rank's return value back; assertions happen in the test process.

CPU shims, test-only: Megatron allocates some sequence-parallel buffers with
``torch.cuda.current_device()``; the workers point that at the CPU. coc-inject's own code
never calls it (a test checks the source).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import traceback
from multiprocessing import connection

from coc_inject.testbed.ranks import AnswerWait, on_a_free_port, rank_context, without_coc_variables


def _resolve(path: str):
    module_name, name = path.split(":")
    return getattr(importlib.import_module(module_name), name)


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch

        torch.set_num_threads(1)
        torch.cuda.current_device = lambda: torch.device("cpu")  # test-only shim, see module doc
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        message = conn.recv()
        if message is None:
            break
        path, kwargs = message
        try:
            conn.send(("ok", _resolve(path)(**kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def cpu_streams():
    """Test-only, on a worker: Megatron's DDP (0.17+) orders its communication against torch.cuda's
    streams; on the CPU there is nothing to order (coc_inject.testbed.cpu; torch only on the worker)."""
    from coc_inject.testbed.cpu import cpu_streams as inert_streams

    return inert_streams()


def reinitialize_model_parallel(**kwargs) -> None:
    """Megatron's parallel state anew (on a worker), the old state's process groups destroyed first:
    Megatron's destroy_model_parallel only forgets them, and each live gloo group keeps an event-loop
    thread that takes CPU -- hundreds of them slowed every later test of a module several times."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    parallel_state.initialize_model_parallel(**kwargs)


class RankPool:
    def __init__(self, world_size: int, timeout: float = 180.0):
        self.world_size = world_size
        self.broken = None
        self.timeout = timeout
        on_a_free_port(self._start)  # again on another port where another process took the first

    def _start(self, port: int) -> None:
        self.broken = None
        context = rank_context()  # the product's: one fork server for the bench's ranks and these
        self.conns, self.procs = [], []
        with without_coc_variables():  # workers start with CoC off; tests install configs explicitly
            for rank in range(self.world_size):
                parent, child = context.Pipe()
                proc = context.Process(target=_worker, args=(rank, self.world_size, port, child), daemon=True)
                proc.start()
                self.conns.append(parent)
                self.procs.append(proc)
        self._collect("startup")

    def _collect(self, what):
        pending = dict(enumerate(self.conns))
        results, errors = {}, []
        wait = AnswerWait(self.timeout)  # once a rank failed, its peers' answers only briefly awaited
        while pending:
            ready = connection.wait(list(pending.values()), timeout=wait.left())
            if not ready:
                break
            for rank in [rank for rank, conn in pending.items() if conn in ready]:
                try:
                    status, value = pending.pop(rank).recv()
                except EOFError:
                    status, value = "error", f"worker exited (exit code {self.procs[rank].exitcode})"
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                    wait.failure()
                results[rank] = value
        errors += [f"rank {rank}: no answer to {what} within {self.timeout}s" + (" (after another rank failed)"
                                                                                 if errors else "")
                   for rank in pending]
        results = [results.get(rank) for rank in range(len(self.conns))]
        if errors:
            # A rank that failed mid-collective leaves its peers blocked: the pool is unusable.
            self.broken = f"{what} failed on a worker:\n" + "\n".join(errors)
            self.close()
            raise RuntimeError(self.broken)
        return results

    def run(self, path: str, **kwargs) -> list:
        """Call ``path`` (``"module:function"``) with ``kwargs`` on every rank; per-rank results."""
        if self.broken:
            raise RuntimeError(f"worker pool is unusable after an earlier failure:\n{self.broken}")
        for conn in self.conns:
            conn.send((path, kwargs))
        return self._collect(path)

    def run_per_rank(self, path: str, kwargs_by_rank: list) -> list:
        """Like run(), with its own keyword arguments for each rank."""
        if self.broken:
            raise RuntimeError(f"worker pool is unusable after an earlier failure:\n{self.broken}")
        for conn, kwargs in zip(self.conns, kwargs_by_rank, strict=True):
            conn.send((path, kwargs))
        return self._collect(path)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=0 if self.broken else 30)
            if proc.is_alive():
                proc.kill()
