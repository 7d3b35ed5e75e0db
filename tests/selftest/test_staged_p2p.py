"""The self-test's ``cuda-gloo`` mode: point-to-point sends staged through host memory (staged_p2p).

On 2 real gloo ranks, every tensor staged (the CPU stands in for the GPU this mode is for): a ring
exchange through the context-parallel schedules' own ``comm.exchange`` delivers every block, and
the self-test's context-parallel wing with ``shared_device`` set passes every case, its ring rows
labelled as staged. ``torch.distributed.batch_isend_irecv`` is restored afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.selftest import staged_p2p


def ring_exchange_case():
    from coc_inject.context_parallel import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    original = dist.batch_isend_irecv
    sends = [torch.full((3, 2), float(10 * rank + i)) for i in range(2)]
    recvs = [torch.zeros(3, 2) for _ in range(2)]
    with staged_p2p.installed(stage=lambda tensor: True):
        comm.exchange(None, [(t, (rank + 1) % world) for t in sends], [(t, (rank - 1) % world) for t in recvs]).wait()
        staged_while_installed = dist.batch_isend_irecv is not original
    left = (rank - 1) % world
    return {"received": [t[0, 0].item() for t in recvs], "expected": [float(10 * left + i) for i in range(2)],
            "staged": staged_while_installed, "restored": dist.batch_isend_irecv is original}


def selftest_cp_case():
    from coc_inject.selftest import context_parallel, run
    from coc_inject.selftest.common import Context

    options = run.parser().parse_args(["--cases", "context-parallel"])
    options.dtype = "float32"
    ctx = Context(torch.device("cpu"), "float32", 1, dist.group.WORLD, dist.get_world_size(), dist.get_rank(),
                  options, p2p_via_host=True)
    shape = context_parallel.SHAPE
    context_parallel.SHAPE = dict(shape, seq=256)  # the self-test's schedules at a quarter of its length (time)
    try:
        with staged_p2p.installed(stage=lambda tensor: True):
            rows = context_parallel.run(ctx)
    finally:
        context_parallel.SHAPE = shape
    return [(r["case"], r["backend"], r.get("passed"), r.get("skipped")) for r in rows]


def test_a_staged_ring_exchange_delivers_every_block(pool2):
    for result in pool2.run("tests.selftest.test_staged_p2p:ring_exchange_case"):
        assert result["received"] == result["expected"]
        assert result["staged"] and result["restored"]


def test_the_cp_wing_passes_with_staged_sends_and_says_so(pool2):
    rows = pool2.run("tests.selftest.test_staged_p2p:selftest_cp_case")[0]
    ran = [r for r in rows if r[3] is None]
    assert ran and all(passed for _, _, passed, _ in ran), rows
    point_to_point = ("ring", "double-ring", "hybrid")  # the algorithms whose blocks travel point to point
    ring = [backend for case, backend, _, _ in ran if case.startswith(point_to_point)]
    assert ring and all(staged_p2p.LABEL in backend for backend in ring), rows
    assert all(staged_p2p.LABEL not in backend for case, backend, _, _ in ran if not case.startswith(point_to_point))


class FakeWork:
    def __init__(self, log, done=False):
        self.log, self.done = log, done

    def wait(self, *args, **kwargs):
        self.log.append("wait")
        self.done = True

    def is_completed(self):
        return self.done


def test_a_receive_is_copied_to_its_device_tensor_only_after_its_transfer():
    """_CopyBack: wait() waits on every work, then copies; is_completed() is False until the transfers are
    done and copies before it says True; a batch with receives but no work is refused."""
    log = []
    host, device_tensor = torch.full((2,), 7.0), torch.zeros(2)

    pending = staged_p2p._CopyBack([FakeWork(log), FakeWork(log)], [(host, device_tensor)])
    assert not pending.is_completed() and device_tensor.sum() == 0
    pending.wait()
    assert log == ["wait", "wait"] and device_tensor.tolist() == [7.0, 7.0]
    device_tensor.zero_()
    pending.wait()  # copied once: a second wait leaves the tensor alone
    assert device_tensor.sum() == 0
    polled_tensor = torch.zeros(2)
    polled = staged_p2p._CopyBack([FakeWork(log, done=True)], [(host, polled_tensor)])
    assert polled.is_completed() and polled_tensor.tolist() == [7.0, 7.0]
    try:
        staged_p2p._CopyBack([], [(host, device_tensor)])
    except RuntimeError as error:
        assert "no work" in str(error)
    else:
        raise AssertionError("receives without a work were accepted")
