"""Point-to-point sends of CUDA tensors staged through host memory, for ranks sharing a GPU over gloo.

gloo cannot send a CUDA tensor point to point (the process aborts, 'writev ... Bad address', seen on
an H100), and NCCL refuses two ranks on one GPU. With this installed (the self-test's ``cuda-gloo``
mode only), ``torch.distributed.batch_isend_irecv`` sends a host copy of each CUDA tensor and
receives into a host buffer that its work's ``wait()`` copies back to the device: the ring-family
context-parallel schedules then run on the device's own attention kernels, with only the transport
unlike a job's. Rows run so say it in their backend.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

LABEL = "p2p staged via host"


class _CopyBack:
    """The works of one batch: waits on the host transfers, then copies each received buffer into
    its device tensor."""

    def __init__(self, works, received):
        if received and not works:
            raise RuntimeError("staged_p2p: receives posted but batch_isend_irecv returned no work to wait on")
        self.works, self.received = works, received

    def wait(self, *args, **kwargs):
        for work in self.works:
            work.wait(*args, **kwargs)
        self._copy_back()
        return True

    def is_completed(self):
        """Done once the host transfers are and the device tensors hold what arrived (copied here)."""
        if not all(work.is_completed() for work in self.works):
            return False
        self._copy_back()
        return True

    def _copy_back(self):
        for host, device_tensor in self.received:
            device_tensor.copy_(host)
        self.received = []


def _host_op(op):
    """(the op on a host tensor, (host buffer, device tensor) for a receive or None)."""
    tensor, sending = op.tensor, op.op in (dist.isend, dist.send)
    host = tensor.detach().cpu() if sending else tensor.new_empty(tensor.shape, device="cpu")
    staged = dist.P2POp(op.op, host, op.peer, op.group, op.tag)
    return staged, None if sending else (host, tensor)


def _on_a_device(tensor) -> bool:
    return tensor.device.type != "cpu"


@contextlib.contextmanager
def installed(stage=_on_a_device):
    """``stage(tensor)``: whether a send or receive of it goes through host memory (the tests stage
    CPU tensors too, to run the same path on the CPU)."""
    original = dist.batch_isend_irecv

    def staged(p2p_op_list):
        ops, received = [], []
        for op in p2p_op_list:
            if not stage(op.tensor):
                ops.append(op)
                continue
            host_op, receive = _host_op(op)
            ops.append(host_op)
            if receive is not None:
                received.append(receive)
        works = original(ops)
        return [_CopyBack(works, received)]  # one wait for the batch, as NCCL's coalesced work

    dist.batch_isend_irecv = staged
    try:
        yield
    finally:
        dist.batch_isend_irecv = original
